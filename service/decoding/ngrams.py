"""``no_repeat_ngram_size`` as an incremental per-sequence ban (`NGramBlocker`), after HF transformers'
``NoRepeatNGramLogitsProcessor``: what greedy, sampling and beam search mask before choosing a token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NGramBlocker"]


class NGramBlocker:
    """``no_repeat_ngram_size`` for one sequence, incrementally: HF ``NoRepeatNGramLogitsProcessor`` semantics.

    The sequence is what HF's processor sees in ``input_ids``: the prefix (prompt of a decoder-only model, decoder
    start token of an encoder-decoder one) followed by the generated tokens. The next token ``t`` is banned iff
    (last ``n - 1`` tokens, ``t``) already occurs as an n-gram anywhere in the sequence; with fewer than ``n``
    tokens nothing can be banned (HF: ``cur_len < n``). ``n == 1`` bans every token seen so far.

    State: a dict from each (n-1)-gram to the set of tokens that followed it, plus the last ``n - 1`` tokens.
    `append` costs O(n) and `banned` is one dict lookup, independent of the sequence length. `copy` (for beam
    search, where several beams continue one row) costs O(number of distinct (n-1)-grams).
    """

    __slots__ = ("_next", "_tail", "n")

    def __init__(self, n: int, tokens: Sequence[int] | np.ndarray = ()):
        if n < 1:
            raise ValueError("n-gram size must be >= 1")
        self.n = int(n)
        self._next: dict[tuple[int, ...], set[int]] = {}  # (n-1)-gram -> tokens that completed it
        self._tail: tuple[int, ...] = ()  # the last min(n - 1, length) tokens
        self.extend(tokens)

    def append(self, token: int) -> None:
        """The sequence grew by ``token``."""
        token = int(token)
        k = self.n - 1
        if len(self._tail) == k:  # (tail, token) is a complete n-gram
            followers = self._next.get(self._tail)
            if followers is None:
                self._next[self._tail] = {token}
            else:
                followers.add(token)
        self._tail = (self._tail + (token,))[-k:] if k else ()

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        for t in np.asarray(tokens, dtype=np.int64).reshape(-1).tolist():
            self.append(t)

    def banned(self) -> set[int] | tuple[()]:
        """Tokens the next position must not take (do not mutate the returned set)."""
        return self._next.get(self._tail, ())

    def banned_ids(self, vocab_size: int) -> np.ndarray:
        """`banned` as an int64 array, ids outside [0, vocab_size) dropped (HF ignores ids past the logits)."""
        b = self.banned()
        ids = np.fromiter(b, dtype=np.int64, count=len(b))
        return ids[(ids >= 0) & (ids < vocab_size)]

    def apply(self, row: np.ndarray) -> np.ndarray:
        """Logits (V,) -> a copy with the banned tokens at -inf (``row`` itself when nothing is banned)."""
        if not self.banned():
            return row
        row = np.array(row, copy=True)
        row[self.banned_ids(row.shape[-1])] = -np.inf
        return row

    def copy(self) -> NGramBlocker:
        new = NGramBlocker.__new__(NGramBlocker)
        new.n = self.n
        new._next = {k: set(v) for k, v in self._next.items()}
        new._tail = self._tail
        return new
