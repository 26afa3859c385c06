"""What the load test records beyond locust's statistics: client-side measurements (time to first token of streams,
generated tokens, images, sentences) and locust's final totals (its CSV files are written every second and may miss
the last one), written to `<csv prefix>_extra.json` at the end; deploy/loadtest.py reads them. Standard library
only."""

from __future__ import annotations

import threading

import load_settings

IMAGE_REQUESTS = ("classify", "oip classify", "grpc classify")  # the request names whose work is images
PERCENTILES = (50, 95, 99)  # the response-time percentiles of the final totals, as deploy/loadtest.py reports them


class Extra:
    """Client-side measurements locust's statistics do not keep, written next to its CSV files at the end."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft_ms: list[float] = []
        self.tokens = {"generate": 0, "generate stream": 0, "openai completion": 0, "openai completion stream": 0,
                       "openai chat": 0, "openai chat stream": 0, "oip generate": 0, "grpc generate stream": 0}
        self.images = 0
        self.sentences = {"translate greedy": 0, "translate beam": 0, "oip translate": 0}

    def add(self, name: str, amount: int, first_token_ms: float | None = None) -> None:
        """Count `amount` of a request's work under its name: generated tokens, sentences, or images (classify and
        oip classify), and a stream's time to first token."""
        with self.lock:
            if first_token_ms is not None:
                self.ttft_ms.append(first_token_ms)
            if name in self.tokens:
                self.tokens[name] += amount
            elif name in self.sentences:
                self.sentences[name] += amount
            elif name in IMAGE_REQUESTS:
                self.images += amount
            else:
                raise KeyError(f"{name!r}: not a request name whose work is counted")

    def as_dict(self) -> dict:
        with self.lock:
            return {"ttft_ms": list(self.ttft_ms), "generated_tokens": dict(self.tokens), "images": self.images,
                    "sentences": dict(self.sentences), "settings": load_settings.as_dict()}


def final_stats(environment) -> dict:
    """locust's totals at the end of the run: its CSV files are written every second and can miss the last one."""

    def entry(stats) -> dict:
        return {"requests": stats.num_requests, "failures": stats.num_failures, "requests_per_s": stats.total_rps,
                "mean_ms": stats.avg_response_time,
                **{f"p{q}_ms": stats.get_response_time_percentile(q / 100) if stats.num_requests else None
                   for q in PERCENTILES}}

    total = environment.stats.total
    return {"total": entry(total), "endpoints": {name: entry(s) for (name, _), s in environment.stats.entries.items()},
            "seconds": max(0.0, (total.last_request_timestamp or total.start_time) - total.start_time)}
