"""A batch job's progress on standard error: a tqdm bar of the lines answered, with lines/s and generated tokens/s
(both averaged from the start), and the one-line summary at the end, printed whether or not the bar shows (by
default only when standard error is a terminal).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

SUMMARY_PREFIX = "service.batch: "
REFRESH_S = 0.5  # the bar's redraw interval: often enough to read the rates, rarely enough to cost nothing


class Progress:
    """`done(tokens, failed)` once per line answered; `close()` ends the bar and writes the summary line."""

    def __init__(self, total: int, skipped: int, show: bool | None = None):
        self.started = time.monotonic()
        self.lines = self.tokens = self.errors = 0
        self.skipped = skipped
        # show None: tqdm's own rule, a bar only on a terminal; smoothing 0: the rates are averages since the start
        self.bar = tqdm(total=total, unit="line", file=sys.stderr, disable=None if show is None else not show,
                        mininterval=REFRESH_S, smoothing=0, dynamic_ncols=True)

    def done(self, tokens: int, failed: bool) -> None:
        self.lines += 1
        self.tokens += tokens
        self.errors += failed
        self.bar.set_postfix_str(f"{self.tokens / self.elapsed():.0f} tok/s, {self.errors} errors", refresh=False)
        self.bar.update()

    def note(self, message: str) -> None:
        """A line on standard error that leaves the bar whole."""
        self.bar.write(message, file=sys.stderr)

    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def close(self) -> None:
        """End the bar and write the summary line (also when the job is interrupted)."""
        self.bar.close()
        seconds = self.elapsed()
        self.note(f"{SUMMARY_PREFIX}{self.lines} lines in {seconds:.1f} s ({self.lines / seconds:.1f} lines/s, "
                  f"{self.tokens / seconds:.0f} tokens/s): {self.errors} errors, {self.skipped} already in the output")
