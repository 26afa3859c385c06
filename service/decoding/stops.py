"""Stop strings: the search's check after every token (`StopStrings`), a stream's hold-back (`StopStrings.held_back`)
and the cut of the final text (`truncate_at_stop`), as OpenAI's ``stop`` and TGI's ``StopSequenceCriteria``.

The check reads the row's text from its own incremental `Detokenizer` (each token decoded once), and looks only
at the newest text plus the characters before it that a stop string could still start in: the cost per token is
bounded by the stop strings' lengths, whatever the length of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .detokenize import Detokenizer

__all__ = ["StopStrings", "truncate_at_stop"]


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest occurrence of any stop string; returns (text, whether one was found)."""
    cut = -1
    for stop in stops:
        if stop:
            i = text.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
    return (text, False) if cut < 0 else (text[:cut], True)


class StopStrings:
    """Stop strings of one row: the search's checker (``checker(generated_tokens) -> bool``) and a stream's
    hold-back (`held_back`).

    ``decode`` maps token ids to text (the search itself never sees a tokenizer). The search calls the checker
    after every appended token with all its generated tokens so far; the tokens it has not seen yet go through
    the row's `Detokenizer` (``text``), and a new occurrence must end in the text they released. One instance per
    row: an array that does not continue the last one starts the row again. The caller cuts the final text with
    `truncate_at_stop`.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.longest = max((len(s) for s in self.stops), default=0)  # in characters
        self.text = Detokenizer(decode)
        self._prefixes: frozenset[str] | None = None  # built by the first `held_back`

    def __call__(self, generated: np.ndarray) -> bool:
        if not self.stops:
            return False
        if len(generated) < len(self.text.ids):  # not this row's continuation: start again
            self.text = Detokenizer(self.decode)
        seen = len(self.text.text)
        if not self.text.add(generated[len(self.text.ids) :]):
            return False
        window = self.text.text[max(0, seen - self.longest + 1) :]  # an occurrence ends in the new text
        return any(s in window for s in self.stops)

    def held_back(self, text: str) -> int:
        """How many characters at the end of ``text`` could still become a stop string: the length of the longest
        suffix of ``text`` that is a proper prefix of some stop string (0 when none is).

        A stream releases everything before them: no stop string can start in released text. Only the last
        ``longest - 1`` characters are looked at (one set lookup per suffix length, longest first), so the cost
        is bounded by the stop strings' lengths, whatever the length of ``text``. ``text`` must hold no complete
        stop string (the caller cuts at one first, with `truncate_at_stop`).
        """
        if self._prefixes is None:
            self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        for k in range(min(len(text), self.longest - 1), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
