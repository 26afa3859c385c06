"""Beam search with exactly the semantics of HF transformers 5.x ``generate(num_beams=N, do_sample=False)``.

Follows ``GenerationMixin._beam_search`` and its helpers for one batch item: log-softmax, then the
``no_repeat_ngram_size`` and ``min_new_tokens`` masks (not renormalised); the top ``max(2, 1 + n_eos) * num_beams``
continuations are candidates; of the best ``num_beams``, those that stop (EOS, or ``max_new_tokens`` reached) enter
the finished set with score ``sum_logprobs / generated_len ** length_penalty`` (new tokens only, EOS included), and
the best ``num_beams`` that did not stop run on, until HF's sticky early-stop heuristic (or ``early_stopping``)
ends the search. Each rule in full: the design notes.

Rows: the search starts from one row (the prefill row: HF's beam scores [0, -1e9, ...] expand beam 0 only at step
0; requires V >= K), then needs ``num_beams`` rows; ``parents`` say which row each new beam continues.

Design notes: docs/architecture.md, service/decoding/beam.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .beam_candidates import search_candidates
from .distributions import log_normaliser
from .forced_prefix import ForcedPrefix
from .ngrams import NGramBlocker
from .types import Hypothesis, Search, StepResult, eos_ids, finished_step

__all__ = ["BeamSearch"]

# The range of a length penalty (the exponent of the generated length a beam's score is divided by), a request's
# and a model config's default alike: beyond it the scores are dominated by length alone.
MAX_LENGTH_PENALTY = 5.0
# HF marks unfilled finished slots with -1e9; the early-stop heuristic compares against it.
_EMPTY_SLOT_SCORE = -1.0e9
# HF keeps max(2, 1 + n_eos) candidates per beam: enough that num_beams of them go on even when the rest stop.
_MIN_CANDIDATES_PER_BEAM = 2


class BeamSearch(Search):
    """HF-compatible beam search for one request.

    ``prefix``: tokens already in the decoder sequence (decoder-only: the prompt; encoder-decoder: the decoder
    start token). Only n-gram blocking looks at it, as HF's processor sees the whole ``input_ids``.
    ``forced_prefix``: tokens the one row emits first, whatever the logits (`ForcedPrefix`): after ``prefix`` for
    the n-gram ban, outside the hypotheses' tokens, their scores and the length penalty's length.
    """

    def __init__(
        self,
        num_beams: int,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
        no_repeat_ngram_size: int = 0,
        min_new_tokens: int = 0,
        prefix: Sequence[int] = (),
        forced_prefix: Sequence[int] = (),
    ):
        if num_beams < 1:
            raise ValueError("num_beams must be >= 1")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 1 <= num_return_sequences <= num_beams:
            raise ValueError("num_return_sequences must be in [1, num_beams]")
        if early_stopping not in (True, False, "never"):
            raise ValueError('early_stopping must be True, False or "never"')
        if no_repeat_ngram_size < 0:
            raise ValueError("no_repeat_ngram_size must be >= 0")
        self.num_beams = int(num_beams)
        self.max_new_tokens = int(max_new_tokens)
        self.eos = eos_ids(eos_token_id)  # (n_eos,)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.num_return_sequences = int(num_return_sequences)
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)
        self.min_new_tokens = int(min_new_tokens)
        self._k = max(_MIN_CANDIDATES_PER_BEAM, 1 + self.eos.size) * self.num_beams  # candidates kept per step
        self._forced = ForcedPrefix(forced_prefix)
        prefix_arr = np.asarray(self._forced.after(prefix), dtype=np.int64)
        self._p = prefix_arr.size
        # (num_beams, P + max_new_tokens): prefix + generated tokens of each running beam, row = beam
        self._hist = np.zeros((self.num_beams, self._p + self.max_new_tokens), dtype=np.int64)
        self._hist[:, : self._p] = prefix_arr
        # one incremental n-gram ban per running beam (row order), None when no_repeat_ngram_size is off
        self._ngrams = [NGramBlocker(self.no_repeat_ngram_size, prefix_arr)] if self.no_repeat_ngram_size else None
        self._scores = np.zeros(1, dtype=np.float64)  # (rows,) accumulated log-probs of the running beams
        self._rows = 1
        self._t = 0  # tokens generated so far by the running beams
        self._finished: list[tuple[float, list[int], str]] = []  # (score, tokens, reason), best first, <= num_beams
        self._improvable = True  # HF is_early_stop_heuristic_unsatisfied
        self._done = False

    @property
    def num_rows(self) -> int:
        return 0 if self._done else self._rows

    @property
    def max_rows(self) -> int:
        return self.num_beams

    @property
    def done(self) -> bool:
        return self._done

    def _block_ngrams(self, x: np.ndarray) -> None:
        """NoRepeatNGram: in place, -inf for every token that would repeat an n-gram of its row. x: (R, V)."""
        vocab = x.shape[1]
        for r, blocker in enumerate(self._ngrams[: x.shape[0]]):
            if blocker.banned():
                x[r, blocker.banned_ids(vocab)] = -np.inf

    def _advance_ngrams(self, parents: np.ndarray, tokens: np.ndarray) -> None:
        """New beam i = row parents[i] + tokens[i]: the first child of a row takes over its blocker, later children
        get copies (taken before any blocker is extended)."""
        taken: set[int] = set()
        new = []
        for p in parents.tolist():
            new.append(self._ngrams[p].copy() if p in taken else self._ngrams[p])
            taken.add(p)
        for blocker, tok in zip(new, tokens.tolist()):
            blocker.append(tok)
        self._ngrams = new

    def step(self, logits: np.ndarray) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished search")
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != self._rows:
            raise ValueError(f"expected logits of shape ({self._rows}, V), got {logits.shape}")
        x = np.array(logits, dtype=logits.dtype if logits.dtype.kind == "f" else np.float64)  # a copy to mask
        return self.step_rows(x, *log_normaliser(x))

    @property
    def candidates(self) -> int:
        """K: the continuations a step keeps (`service.decoding.beam_candidates`)."""
        return self._k

    @property
    def row_candidates(self) -> int:
        """Per row, the K candidates plus the tokens its processors ban at the next step: among that many most
        likely tokens of a row are its K best that are not banned."""
        banned = 0
        if self._ngrams is not None:
            banned = max(len(blocker.banned()) for blocker in self._ngrams[: self._rows])
        if self._t < self.min_new_tokens:
            banned += self.eos.size
        return self._k + banned

    @property
    def masks(self) -> bool:
        """Whether its processors ban any token at the next step (n-gram bans, or EOS before min_new_tokens)."""
        return self._ngrams is not None or (self._t < self.min_new_tokens and self.eos.size > 0)

    def mask_candidates(self, logprobs: np.ndarray, ids: np.ndarray) -> None:
        """`mask` on each row's most likely tokens instead of its logits: ``logprobs`` (num_rows, k) float64 of
        the tokens ``ids`` (num_rows, k) go to -inf, in place, where the processors ban the token."""
        if self._ngrams is not None:
            for r, blocker in enumerate(self._ngrams[: ids.shape[0]]):
                if blocker.banned():
                    logprobs[r, np.isin(ids[r], np.fromiter(blocker.banned(), np.int64))] = -np.inf
        if self._t < self.min_new_tokens and self.eos.size:
            logprobs[(ids[..., None] == self.eos).any(axis=-1)] = -np.inf

    @property
    def beam_scores(self) -> np.ndarray:
        """(num_rows,) the accumulated log-probs of the running beams, row order."""
        return self._scores

    def step_rows(self, x: np.ndarray, peak: np.ndarray, log_z: np.ndarray) -> StepResult:
        """`step` on raw logits ``x`` (num_rows, V), float32 or float64, that this method may modify, with their
        `log_normaliser` terms ``peak`` and ``log_z`` (num_rows,). The log-probs are ``(x - peak) - log_z`` in
        float64, as `log_softmax`. (`service.decoding.step_searches` does `mask` and `advance` itself, with the
        candidates of every search of a step found together.)"""
        self.mask(x)
        return self.advance(*search_candidates(x, peak, log_z, self._scores, self._k), x.shape[1])

    def mask(self, x: np.ndarray) -> None:
        """Step part b, the processors (HF order: NoRepeatNGram, then MinNewTokensLength), in place on this
        search's raw logits ``x`` (num_rows, V): a token at -inf has log-prob -inf, the others keep theirs, as
        masking the log-probs would (no renormalisation)."""
        if self._ngrams is not None:
            self._block_ngrams(x)
        if self._t < self.min_new_tokens and self.eos.size:
            x[:, self.eos] = -np.inf

    def advance(self, top: np.ndarray, top_scores: np.ndarray, vocab: int) -> StepResult:
        """Step parts d-g from part c's result: the top-K continuations ``top`` as flat indices ``row * V +
        token``, best first, ties by lower index, and their accumulated scores ``top_scores`` (K,)."""
        if self._forced.pending:  # a forced step: its one row takes the next prefix token, its score stays 0
            return self._forced.emit()
        nb, t, p = self.num_beams, self._t, self._p
        beams, toks = np.divmod(top, vocab)  # (K,) row each candidate extends, its token
        # np.isin sorts: 10x slower for K tokens
        is_eos = toks == self.eos[0] if self.eos.size == 1 else (toks[:, None] == self.eos).any(axis=1)

        # d. stopping criteria: EOS or max length
        stops = is_eos | (t + 1 >= self.max_new_tokens)  # (K,)
        best_stop = bool(stops[:nb].any())

        # f. only the best num_beams candidates may finish
        denom = float(t + 1) ** self.length_penalty
        added = False
        for j in np.flatnonzero(stops[:nb]) if best_stop else ():
            if not np.isfinite(top_scores[j]):
                continue
            tokens = self._hist[beams[j], p : p + t].tolist()
            if not is_eos[j]:
                tokens.append(int(toks[j]))
            self._finished.append((float(top_scores[j]) / denom, tokens, "eos" if is_eos[j] else "length"))
            added = True
        if added:
            self._finished.sort(key=lambda h: -h[0])
            del self._finished[nb:]

        # e. next running beams: the best num_beams candidates that did not stop
        keep = np.flatnonzero(~stops)[:nb] if best_stop else np.arange(min(nb, stops.size))
        self._t = t + 1
        if keep.size:
            parents = beams[keep]
            self._hist[: keep.size, p : p + t] = self._hist[parents, p : p + t]  # fancy index copies first
            self._hist[: keep.size, p + t] = toks[keep]
            if self._ngrams is not None:
                self._advance_ngrams(parents, toks[keep])
            self._scores = top_scores[keep]
            self._rows = keep.size

        # g. beam-search-level stopping condition
        full = len(self._finished) >= nb
        if self._improvable and keep.size:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_new_tokens
            else:
                best_len = self._t
            best = self._scores[0] / float(best_len) ** self.length_penalty
            worst = self._finished[-1][0] if full else _EMPTY_SLOT_SCORE
            self._improvable = bool(best > worst)
        if not self._improvable or (full and self.early_stopping is True) or keep.size == 0:
            self._done = True
            return finished_step()
        return StepResult(tokens=toks[keep].astype(np.int64), parents=parents.astype(np.int64), done=False)

    def results(self) -> list[Hypothesis]:
        if not self._done:
            raise RuntimeError("results() before the search is done")
        return [
            Hypothesis(tokens=list(tokens), score=score, finish_reason=reason)
            for score, tokens, reason in self._finished[: self.num_return_sequences]
        ]
