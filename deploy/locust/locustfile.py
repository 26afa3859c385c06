"""Load test of the tserve HTTP API with real inputs: Multi30k validation sentences (German) for /v1/translate,
slices of tinyshakespeare's validation text for /v1/generate, Fashion-MNIST test images as PNG files for
/v1/classify.

    make loadtest USERS=8 SPAWN_RATE=4 DURATION=60s HOST=127.0.0.1 PORT=8000
    locust -f deploy/locust/locustfile.py --host http://127.0.0.1:8000          # web UI on :8089

Each simulated user runs a closed loop: request, wait `TSERVE_LOAD_THINK_S` on average, next request, chosen by
weight among the tasks below. Every response is checked (status, shape, counts; a stream must end with `[DONE]`
and carry no error event): anything else is a failure in locust's statistics.

Request names in the statistics: `translate greedy`, `translate beam`, `generate`, `generate stream`, `classify`.
A streamed request's response time is the whole stream (to `[DONE]`), not the time to the response headers.
Client-side extras locust does not keep (time to first token of streams, generated tokens, images, sentences),
and locust's final totals (its CSV files are written every second and may miss the last one), are written to
`<csv prefix>_extra.json` when locust runs with `--csv`; `deploy/loadtest.py` reads them.

Settings (environment):
  TSERVE_DATA_DIR              data folder (default ../shared/data, then ./data, as the project's loaders)
  TSERVE_LOAD_WEIGHTS          task weights, default
                               "translate_greedy=3,translate_beam=2,generate=2,generate_stream=2,classify=3"
  TSERVE_LOAD_THINK_S          mean wait between a user's requests, seconds (default 0.1; 0 = back to back)
  TSERVE_LOAD_NUM_BEAMS        beam width of `translate beam` (default 4)
  TSERVE_LOAD_PROMPT_CHARS     GPT prompt length in characters = tokens, byte-level (default 16)
  TSERVE_LOAD_MAX_NEW_TOKENS   GPT max_new_tokens (default 32). Prompt + new tokens must fit the model's
                               context: 64 tokens for the tiny preset, 256 for release
  TSERVE_LOAD_MAX_IMAGES       images per classify request, uniformly 1..N (default 4)
  TSERVE_LOAD_TIMEOUT_MS       timeout_ms sent with every request (default: none, the server's default)
  TSERVE_LOAD_SEED             seed of the input choices (default 0)
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from locust import HttpUser, between, events, task

try:
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare
except ImportError:  # run from a checkout without the project installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from models.data import load_fashion_mnist, load_multi30k, load_shakespeare

DEFAULT_WEIGHTS = "translate_greedy=3,translate_beam=2,generate=2,generate_stream=2,classify=3"
TASKS = ("translate_greedy", "translate_beam", "generate", "generate_stream", "classify")


def _env_int(name: str, default: int, minimum: int = 0) -> int:
    value = int(os.environ.get(name, default))
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    return value


def _weights(text: str) -> dict[str, int]:
    weights = dict.fromkeys(TASKS, 0)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in weights or not value.strip().isdigit():
            raise ValueError(f"TSERVE_LOAD_WEIGHTS: bad item {item!r}; expected NAME=INT with NAME in {TASKS}")
        weights[name] = int(value)
    if not any(weights.values()):
        raise ValueError("TSERVE_LOAD_WEIGHTS: every weight is 0")
    return weights


DATA_DIR = os.environ.get("TSERVE_DATA_DIR") or None  # None: the loaders' defaults (../shared/data, ./data)
WEIGHTS = _weights(os.environ.get("TSERVE_LOAD_WEIGHTS", DEFAULT_WEIGHTS))
THINK_S = float(os.environ.get("TSERVE_LOAD_THINK_S", "0.1"))
NUM_BEAMS = _env_int("TSERVE_LOAD_NUM_BEAMS", 4, minimum=2)
PROMPT_CHARS = _env_int("TSERVE_LOAD_PROMPT_CHARS", 16, minimum=1)
MAX_NEW_TOKENS = _env_int("TSERVE_LOAD_MAX_NEW_TOKENS", 32, minimum=1)
MAX_IMAGES = _env_int("TSERVE_LOAD_MAX_IMAGES", 4, minimum=1)
TIMEOUT_MS = _env_int("TSERVE_LOAD_TIMEOUT_MS", 0)
SEED = _env_int("TSERVE_LOAD_SEED", 0)
N_INPUTS = 500  # distinct sentences / prompts / images kept in memory


def _load_inputs():
    rng = random.Random(SEED)
    pairs = load_multi30k(DATA_DIR, "val")
    sentences = [de for de, _ in rng.sample(pairs, min(N_INPUTS, len(pairs))) if de]
    _, val_text = load_shakespeare(DATA_DIR)
    prompts = []
    while len(prompts) < N_INPUTS:
        start = rng.randrange(0, len(val_text) - PROMPT_CHARS)
        prompt = val_text[start : start + PROMPT_CHARS]
        if prompt.strip():
            prompts.append(prompt)
    from PIL import Image

    images, labels = load_fashion_mnist(DATA_DIR, "test")
    pngs = []
    for index in rng.sample(range(len(images)), min(N_INPUTS, len(images))):
        buffer = io.BytesIO()
        Image.fromarray(images[index]).save(buffer, format="PNG")
        pngs.append((f"fashion-mnist-test-{index}.png", buffer.getvalue(), int(labels[index])))
    return sentences, prompts, pngs


SENTENCES, PROMPTS, PNGS = _load_inputs()


class _Extra:
    """Client-side measurements locust's statistics do not keep, written next to its CSV files at the end."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft_ms: list[float] = []
        self.tokens = {"generate": 0, "generate stream": 0}
        self.images = 0
        self.sentences = {"translate greedy": 0, "translate beam": 0}

    def as_dict(self) -> dict:
        with self.lock:
            return {"ttft_ms": list(self.ttft_ms), "generated_tokens": dict(self.tokens), "images": self.images,
                    "sentences": dict(self.sentences),
                    "settings": {"weights": WEIGHTS, "think_s": THINK_S, "num_beams": NUM_BEAMS,
                                 "prompt_chars": PROMPT_CHARS, "max_new_tokens": MAX_NEW_TOKENS,
                                 "max_images": MAX_IMAGES, "timeout_ms": TIMEOUT_MS or None, "seed": SEED}}


EXTRA = _Extra()


@events.test_start.add_listener
def _reset_extra(environment, **_):
    global EXTRA
    EXTRA = _Extra()


def _final_stats(environment) -> dict:
    """locust's totals at the end of the run: its CSV files are written every second and can miss the last one."""

    def entry(stats) -> dict:
        return {"requests": stats.num_requests, "failures": stats.num_failures, "requests_per_s": stats.total_rps,
                "mean_ms": stats.avg_response_time,
                **{f"p{q}_ms": stats.get_response_time_percentile(q / 100) if stats.num_requests else None
                   for q in (50, 95, 99)}}

    total = environment.stats.total
    return {"total": entry(total), "endpoints": {name: entry(s) for (name, _), s in environment.stats.entries.items()},
            "seconds": max(0.0, (total.last_request_timestamp or total.start_time) - total.start_time)}


@events.quitting.add_listener
def _write_extra(environment, **_):
    prefix = getattr(environment.parsed_options, "csv_prefix", None) if environment.parsed_options else None
    if prefix:
        Path(f"{prefix}_extra.json").write_text(json.dumps({**EXTRA.as_dict(), "final": _final_stats(environment)}))


def _error_text(response) -> str:
    try:
        return json.dumps(response.json().get("error", response.json()))[:300]
    except Exception:
        return (response.text or "")[:300]


class TserveUser(HttpUser):
    wait_time = between(0, 2 * THINK_S)

    def on_start(self):
        self.rng = random.Random(f"{SEED}-{id(self)}")

    def _with_timeout(self, body: dict) -> dict:
        if TIMEOUT_MS:
            body["timeout_ms"] = TIMEOUT_MS
        return body

    # --- translation ------------------------------------------------------------------------------------------

    def _translate(self, name: str, num_beams: int) -> None:
        body = self._with_timeout({"text": self.rng.choice(SENTENCES), "num_beams": num_beams})
        with self.client.post("/v1/translate", json=body, name=name, catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            translations = response.json().get("translations")
            if not (isinstance(translations, list) and len(translations) == 1 and translations[0]
                    and isinstance(translations[0][0].get("text"), str)):
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.sentences[name] += 1

    @task(WEIGHTS["translate_greedy"])
    def translate_greedy(self):
        self._translate("translate greedy", 1)

    @task(WEIGHTS["translate_beam"])
    def translate_beam(self):
        self._translate("translate beam", NUM_BEAMS)

    # --- generation -------------------------------------------------------------------------------------------

    def _generate_body(self, stream: bool) -> dict:
        return self._with_timeout({"prompt": self.rng.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS,
                                   "temperature": 0.8, "top_k": 40, "seed": self.rng.randrange(2**31),
                                   "stream": stream})

    @task(WEIGHTS["generate"])
    def generate(self):
        with self.client.post("/v1/generate", json=self._generate_body(False), name="generate",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            body = response.json()
            tokens = body.get("usage", {}).get("completion_tokens")
            if not isinstance(body.get("text"), str) or not isinstance(tokens, int) or tokens > MAX_NEW_TOKENS:
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.tokens["generate"] += tokens

    @task(WEIGHTS["generate_stream"])
    def generate_stream(self):
        started = time.perf_counter()
        with self.client.post("/v1/generate", json=self._generate_body(True), name="generate stream", stream=True,
                              catch_response=True) as response:
            if response.status_code != 200:
                response.request_meta["response_length"] = len(response.content or b"")
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            first_token_ms, events_seen, done, length, problem, tokens = None, 0, False, 0, None, 0
            try:
                for line in response.iter_lines():
                    length += len(line) + 1
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:]
                    if payload == b"[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        problem = f"error event: {json.dumps(event['error'])[:300]}"
                        break
                    if first_token_ms is None:
                        first_token_ms = (time.perf_counter() - started) * 1000
                    events_seen += 1
                    if "usage" in event:  # the last event: finish_reason and usage
                        tokens = event["usage"]["completion_tokens"]
            except Exception as error:  # connection reset mid-stream, bad JSON
                problem = f"stream broken after {events_seen} events: {error!r}"
            finally:
                response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
                response.request_meta["response_length"] = length
            if problem is None and not done:
                problem = f"stream ended without [DONE] after {events_seen} events"
            if problem:
                return response.failure(problem)
            with EXTRA.lock:
                if first_token_ms is not None:
                    EXTRA.ttft_ms.append(first_token_ms)
                EXTRA.tokens["generate stream"] += tokens

    # --- classification ---------------------------------------------------------------------------------------

    @task(WEIGHTS["classify"])
    def classify(self):
        chosen = self.rng.sample(PNGS, self.rng.randint(1, MAX_IMAGES))
        files = [("files", (name, data, "image/png")) for name, data, _ in chosen]
        fields = {"top_k": "3", **({"timeout_ms": str(TIMEOUT_MS)} if TIMEOUT_MS else {})}
        with self.client.post("/v1/classify", files=files, data=fields, name="classify",
                              catch_response=True) as response:
            if response.status_code != 200:
                return response.failure(f"HTTP {response.status_code}: {_error_text(response)}")
            predictions = response.json().get("predictions")
            if not (isinstance(predictions, list) and len(predictions) == len(chosen)
                    and all(len(p) == 3 for p in predictions)):
                return response.failure(f"unexpected body: {response.text[:300]}")
            with EXTRA.lock:
                EXTRA.images += len(chosen)
