"""Shared pieces of the decoding strategies: results, the `Search` protocol and a reference driver.

A search is a small per-request state machine over *rows* (rows of a KV cache). A driver runs the model for
all rows of all active searches, hands each search the next-token logits of its own rows, and the search answers
with the tokens to append and, for every new row, which of its current rows it continues (`parents`). Beam
reordering and dropping finished rows are therefore one and the same row-selection operation on the cache.

Protocol (the same for every search, see `batch_step.run_search` for a complete driver):

1. A new search needs exactly one row, the *prefill row*: the prompt for a decoder-only model, the decoder start
   token (with the encoder output of its source) for an encoder-decoder model. The driver runs the prefill and
   calls ``search.step(first_logits)`` with the logits at the last prefill position, shape (1, V).
2. Every ``step(logits)`` returns a `StepResult`: new row ``i`` is current row ``parents[i]`` extended by
   ``tokens[i]``. The driver selects the cache rows by ``parents``, feeds ``tokens`` and calls ``step`` again
   with the logits of the new rows, shape (num_rows, V), in the order given by the result.
3. Once ``done`` is true the result holds zero rows, the search needs no rows any more and ``results()`` gives
   the finished hypotheses, best first.

The strategies follow Hugging Face transformers ``generate()`` semantics (greedy, multinomial sampling and the
vectorised beam search of transformers 5.x). Everything is numpy: no torch, no ONNX, no asyncio.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Hypothesis",
    "NGramBlocker",
    "Search",
    "StepResult",
    "StopStrings",
    "TokenLogprob",
    "eos_ids",
    "log_softmax",
    "top_logprobs",
    "truncate_at_stop",
]

FINISH_REASONS = ("eos", "length", "stop")


@dataclass(slots=True)
class TokenLogprob:
    """Log-probabilities recorded for one generated token (OpenAI ``logprobs`` / ``top_logprobs``).

    All values come from the model's RAW distribution at that position: log-softmax of the unprocessed logits
    the search received (before penalties, n-gram ban, EOS masking, temperature, top-k/top-p), the same quantity
    the hypothesis score sums. ``logprob`` is that of the chosen ``token_id``; ``top`` holds the N most likely
    tokens as (token id, log-prob), best first, ties by lower id first (empty for N = 0). A log-prob may be
    ``-inf`` where the raw logits hold -inf (JSON has no -inf: the serving layer must map it).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Hypothesis:
    """One finished output sequence.

    ``tokens`` are the generated tokens only (no prompt, no decoder start token, EOS excluded); ``score`` is the
    strategy's score (sum of log-probs, length-normalised for beam search); ``finish_reason`` is one of
    "eos" | "length" | "stop"; ``text`` is left for callers that detokenise. ``logprobs``: one `TokenLogprob`
    per entry of ``tokens`` when the search recorded them (``GreedySearch``/``SamplingSearch`` with
    ``logprobs=N``), else None (always None for beam search).
    """

    tokens: list[int]
    score: float
    finish_reason: str
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StepResult:
    """Answer of one `Search.step`: new row ``i`` = current row ``parents[i]`` + ``tokens[i]``.

    ``tokens`` and ``parents`` are int64 arrays of shape (new_rows,); ``parents`` index the rows whose logits
    were passed to `step`. ``done`` means the search is finished and ``new_rows == 0``.
    """

    tokens: np.ndarray
    parents: np.ndarray
    done: bool


_EMPTY = np.zeros(0, dtype=np.int64)


def finished_step() -> StepResult:
    """The `StepResult` of a search that has just finished (no rows left)."""
    return StepResult(tokens=_EMPTY.copy(), parents=_EMPTY.copy(), done=True)


def eos_ids(eos_token_id: int | Sequence[int] | None) -> np.ndarray:
    """Normalise an EOS id (int, several ids or None) to an int64 array of shape (n_eos,)."""
    if eos_token_id is None:
        return _EMPTY.copy()
    if isinstance(eos_token_id, (int, np.integer)):
        return np.array([int(eos_token_id)], dtype=np.int64)
    return np.asarray(list(eos_token_id), dtype=np.int64).reshape(-1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, computed in float64. (..., V) -> (..., V)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    shifted = x - m
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def top_logprobs(row: np.ndarray, n: int, m: float, log_z: float) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of raw logits ``row`` (V,) float64 as (id, log-prob), best first, ties by lower
    id first. ``m`` (the row max) and ``log_z`` (log-sum-exp of ``row - m``) are what the caller already computed:
    log-prob = ``(row - m) - log_z``, bit-identical to `log_softmax`. Cost: one argpartition and one comparison
    over V, a sort of ``n`` items only (no full sort).
    """
    v = row.shape[0]
    n = min(int(n), v)
    if n <= 0:
        return []
    if n < v:
        idx = np.argpartition(-row, n - 1)[:n]  # the n largest, in no order, ties at the boundary arbitrary
        kth = row[idx].min()
        tied_in = row[idx] == kth
        tied_all = np.flatnonzero(row == kth)
        if tied_all.size > np.count_nonzero(tied_in):  # boundary tie: keep the lowest ids among the tied
            idx = np.concatenate([idx[~tied_in], tied_all[: np.count_nonzero(tied_in)]])
    else:
        idx = np.arange(v)
    vals = row[idx]
    order = np.lexsort((idx, -vals))  # by value descending, then id ascending
    idx, vals = idx[order], (vals[order] - m) - log_z
    return list(zip(idx.tolist(), vals.tolist()))


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest occurrence of any stop string; returns (text, whether one was found)."""
    cut = -1
    for stop in stops:
        if stop:
            i = text.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
    return (text, False) if cut < 0 else (text[:cut], True)


# Tokens decoded beyond the longest stop string's bytes: slack for a tail that starts inside a character (its
# first bytes decode to U+FFFD) and for tokens that decode to nothing; costs a few bytes of decoding per step.
STOP_TAIL_SLACK_TOKENS = 8


class StopStrings:
    """Stop strings of one request: the search's checker (``checker(generated_tokens) -> bool``) and a stream's
    hold-back (`held_back`).

    ``decode`` maps token ids to text (the search itself never sees a tokenizer). The search calls the checker
    after every appended token, so a new occurrence must end in the newest tokens: only the last
    ``tail_tokens`` tokens are decoded (default: the longest stop string in UTF-8 bytes + STOP_TAIL_SLACK_TOKENS,
    which assumes a token decodes to at least one byte, as a byte-level token does even when it is a fraction of a
    character; pass ``tail_tokens=None`` to decode everything each step). The caller cuts the final text with
    `truncate_at_stop`.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str], tail_tokens: int | None = -1):
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.longest = max((len(s) for s in self.stops), default=0)  # in characters
        longest_bytes = max((len(s.encode("utf-8", "surrogatepass")) for s in self.stops), default=0)
        self.tail_tokens = longest_bytes + STOP_TAIL_SLACK_TOKENS if tail_tokens == -1 else tail_tokens
        self._prefixes: frozenset[str] | None = None  # built by the first `held_back`

    def __call__(self, generated: np.ndarray) -> bool:
        if not self.stops:
            return False
        tail = generated if self.tail_tokens is None else generated[-self.tail_tokens :]
        text = self.decode([int(t) for t in tail])
        return any(s in text for s in self.stops)

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


class Search(ABC):
    """A per-request decoding state machine (see the module docstring for the protocol)."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows this search needs in the cache for its next `step` (1 before the first step, 0 once done)."""

    single_row = False  # True: one row from start to end, stepped by the batched sampler (`step_searches`)

    @property
    def max_rows(self) -> int:
        """The most rows this search holds at once (its beam width): what a scheduler reserves for it."""
        return 1

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether the search has finished; `results` is valid from then on."""

    @abstractmethod
    def step(self, logits: np.ndarray) -> StepResult:
        """Consume next-token logits (num_rows, V), raw and un-normalised, and choose the next rows."""

    @abstractmethod
    def results(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (valid once `done`)."""
