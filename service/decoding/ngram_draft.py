"""Draft tokens without a draft model: prompt lookup (n-gram) speculation for one row, after vLLM's
``NgramProposer`` (``vllm/v1/spec_decode/ngram_proposer.py``) and llama.cpp's ``common/ngram-cache``.

`NGramDrafter` keeps an index of every n-gram (``min_n`` <= n <= ``max_n``) of the row's context (prompt + generated
tokens) to the position where it last ended, updated incrementally (O(max_n) per token, never a rescan). A draft is
what followed the most recent earlier occurrence of the longest n-gram that ends the context; when that continuation
runs into the context's end, it goes on with itself (a repetition loop drafts its whole period).

The draft length adapts to acceptance (Hugging Face's and ONNX Runtime GenAI's heuristic, with a faster back-off):
every draft token accepted -> the next may be `GROW` longer, up to ``max_draft``; else as long as the accepted run
plus one. A row whose acceptance over its last `window` draft tokens falls below `min_acceptance` stops drafting
for `pause` steps (twice as long each time it fails again), then starts afresh (llama.cpp and vLLM report n-gram
drafts that lose where text does not repeat).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

__all__ = ["NGramDrafter"]

# The numbers below were chosen by replaying the release GPT's greedy continuations of 60 tinyshakespeare
# validation prompts and 4 repetitive ones through the drafter, with each verify pass costed as measured (1.6 to 2.8
# plain steps for 2 to 9 tokens, fp32; 1.7 to 4.4, int8; AMD EPYC, 2 cores): docs/speculation.md.
MAX_N = 8  # longest n-gram looked up (tokens are bytes here)
MIN_N = 5  # shortest: shorter matches (a space and a few letters) drafted text that was mostly rejected
MAX_DRAFT = 8  # the longest draft (K), TSERVE_SPECULATION_MAX_DRAFT's default
FIRST_DRAFT = 2  # a row's first draft length, before any acceptance is known
GROW = 2  # every token of a draft accepted: the next draft may be this much longer (GenAI's and HF's step)
WINDOW = 32  # draft tokens over which a row's acceptance rate is judged
MIN_ACCEPTANCE = 0.4  # below this rate over the window, the row pauses: its verify passes cost more than they save
PAUSE = 32  # steps a paused row drafts nothing, before it tries again with a fresh window; doubled each time it
MAX_PAUSE = 512  # pauses again without a good window in between, up to this (text that never repeats costs ~nothing)


class NGramDrafter:
    """The n-gram index, the draft length and the acceptance window of one row."""

    def __init__(self, context: Sequence[int] = (), max_n: int = MAX_N, min_n: int = MIN_N,
                 max_draft: int = MAX_DRAFT, window: int = WINDOW, min_acceptance: float = MIN_ACCEPTANCE,
                 pause: int = PAUSE, max_pause: int = MAX_PAUSE):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        if max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        self.max_n, self.min_n, self.max_draft = max_n, min_n, max_draft
        self.window, self.min_acceptance, self.pause, self.max_pause = window, min_acceptance, pause, max_pause
        self._next_pause = pause  # the length of the row's next pause
        self.draft_length = min(FIRST_DRAFT, max_draft)  # K, adapted by `record`
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the position of its last token, most recent wins
        self._indexed = 0  # the n-grams ending before this position are in `_last` (all but those ending last)
        self._recent: deque[tuple[int, int]] = deque()  # (drafted, accepted) of the latest drafts
        self._drafted = self._accepted = 0  # their sums
        self._paused = 0  # steps left without drafting
        self.extend(context)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """The context grew by ``tokens``. Indexes the n-grams ending at every position but the new last one, whose
        n-grams are the lookup keys (a match must lie earlier)."""
        self.tokens.extend(int(t) for t in tokens)
        seq, last = self.tokens, self._last
        for end in range(self._indexed, len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last[tuple(seq[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, len(seq) - 1)

    def propose(self, limit: int | None = None) -> list[int]:
        """The draft for the tokens after the context: up to ``min(draft_length, limit)`` tokens, none when no
        n-gram of the context's end occurred before or while the row is paused (a paused row's steps count down)."""
        if self._paused:
            self._paused -= 1
            return []
        k = self.draft_length if limit is None else min(self.draft_length, limit)
        seq = self.tokens
        if k < 1 or len(seq) <= self.min_n:
            return []
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            end = self._last.get(tuple(seq[-n:]))
            if end is not None:
                return self._continuation(end + 1, k)
        return []

    def _continuation(self, start: int, k: int) -> list[int]:
        """``k`` tokens from ``start`` on, continuing with the draft itself past the context's end (a copy of a
        period that ends where the context ends repeats)."""
        seq, draft = self.tokens, []
        for j in range(k):
            at = start + j
            draft.append(seq[at] if at < len(seq) else draft[at - len(seq)])
        return draft

    def record(self, drafted: int, accepted: int) -> None:
        """A verify pass of a draft of ``drafted`` tokens kept its first ``accepted``: adapt the draft length, and
        pause the row when its acceptance over the window is too low."""
        if drafted < 1:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        self.draft_length = min(self.max_draft, self.draft_length + GROW) if accepted == drafted \
            else max(1, accepted + 1)
        self._recent.append((drafted, accepted))
        self._drafted += drafted
        self._accepted += accepted
        while self._drafted - self._recent[0][0] >= self.window:  # keep just enough drafts to fill the window
            old_drafted, old_accepted = self._recent.popleft()
            self._drafted -= old_drafted
            self._accepted -= old_accepted
        if self._drafted < self.window:
            return
        if self._accepted >= self.min_acceptance * self._drafted:
            self._next_pause = self.pause  # a good window: the next pause is short again
            return
        self._paused, self._next_pause = self._next_pause, min(2 * self._next_pause, self.max_pause)
        self._recent.clear()
        self._drafted = self._accepted = 0
        self.draft_length = min(FIRST_DRAFT, self.max_draft)

    @property
    def paused(self) -> bool:
        return self._paused > 0

    @property
    def acceptance(self) -> float | None:
        """Accepted / drafted tokens over the current window (None before any draft)."""
        return self._accepted / self._drafted if self._drafted else None
