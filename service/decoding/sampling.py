"""Single-row decoding: `SamplingSearch`, one sequence sampled with HF ``generate(do_sample=True)`` logits
processing (greedy decoding is its temperature 0, see `GreedySearch`), and `step_single_rows`, the step of many
such searches at once through the batched sampler (`service.decoding.sampler`).

Per step, on the raw logits, in HF ``_get_logits_processor``'s order: repetition penalty, OpenAI's
``frequency_penalty`` / ``presence_penalty`` (vLLM's order and formula), ``no_repeat_ngram_size``,
``min_new_tokens`` EOS masking and a constraint's mask (`service.decoding.constraints`), then temperature, top-k and
top-p, then a draw with ``np.random.default_rng(seed)`` (same seed, same output; HF's torch RNG is not reproduced);
temperature 0 is the argmax after the penalties and masks. Scores and ``logprobs`` are the raw logits' log-softmax,
before any processing (a constraint's mask included, as vLLM reports them by default).

A search holds its request's state; `step_single_rows` hands the sampler that state as arrays (`RowParams`) and
each search the token chosen for it (`SamplingSearch.accept`).

Design notes: docs/architecture.md, service/decoding/sampling.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import sampler
from .constraints import RowConstraint, allow_rows
from .distributions import log_normaliser, top_logprobs
from .forced_prefix import ForcedPrefix
from .ngrams import NGramBlocker
from .processors import GREEDY_TEMPERATURE
from .types import Hypothesis, Search, StepResult, TokenLogprob, eos_ids, finished_step, isolated

__all__ = ["SamplingSearch", "step_single_rows"]

# OpenAI's range for presence_penalty and frequency_penalty.
MAX_OPENAI_PENALTY = 2.0

NOT_RECORDED: list = []  # `accept`'s alternatives for a search that records no log-probabilities: never read
_ZERO = np.zeros(1, dtype=np.int64)  # every single-row step continues row 0: one shared, read-only array
_ZERO.flags.writeable = False


class SamplingSearch(Search):
    """Sample one sequence (see the module docstring for the processing order).

    ``stop_checker(generated_tokens) -> bool`` (e.g. `StopStrings`) is called with the int64 array of generated
    tokens after every non-EOS token; True ends the sequence with finish_reason "stop".
    ``prefix``: tokens already in the sequence that the repetition penalty and the n-gram ban also cover (HF's
    processors see the whole ``input_ids``: the prompt for a decoder-only model, the decoder start token for an
    encoder-decoder one). ``no_repeat_ngram_size``: 0 = off.
    ``logprobs``: None records nothing (no cost); N >= 0 records one `TokenLogprob` per generated token (the
    chosen token's raw log-prob and the top N of the raw distribution), see `token_logprobs`.
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI): subtract ``presence_penalty`` from the logit of
    every token generated at least once and ``frequency_penalty`` times its count; negative values encourage
    repetition. The prefix does not count.
    ``constraint``: what the row may emit (`RowConstraint`): its disallowed tokens are banned at every step (EOS
    among them until the constraint accepts), and a constraint that can take no further token ends the sequence
    with finish_reason "stop".
    ``forced_prefix``: tokens emitted first, whatever the logits (`ForcedPrefix`): after ``prefix`` for the
    processors, outside the generated tokens and the score.
    """

    single_row = True  # steps through `step_single_rows`, many requests at once

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        seed: int | None = None,
        prefix: Sequence[int] = (),
        stop_checker: Callable[[np.ndarray], bool] | None = None,
        no_repeat_ngram_size: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
        constraint: RowConstraint | None = None,
        forced_prefix: Sequence[int] = (),
    ):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if no_repeat_ngram_size < 0:
            raise ValueError("no_repeat_ngram_size must be >= 0")
        if logprobs is not None and logprobs < 0:
            raise ValueError("logprobs must be None or >= 0")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not -MAX_OPENAI_PENALTY <= presence_penalty <= MAX_OPENAI_PENALTY:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -MAX_OPENAI_PENALTY <= frequency_penalty <= MAX_OPENAI_PENALTY:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        self.max_new_tokens = int(max_new_tokens)
        self.eos = eos_ids(eos_token_id)  # (n_eos,)
        self._eos_set = frozenset(self.eos.tolist())  # `in` on a set, not on an array, every step
        self.min_new_tokens = int(min_new_tokens)
        self.stop_checker = stop_checker
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)
        self._forced = ForcedPrefix(forced_prefix)
        self._prefix = np.asarray(self._forced.after(prefix), dtype=np.int64)  # (P,)
        # incremental n-gram ban over prefix + generated tokens; None when off
        self._ngrams = NGramBlocker(self.no_repeat_ngram_size, self._prefix) if self.no_repeat_ngram_size else None
        self._tokens = np.zeros(self.max_new_tokens, dtype=np.int64)  # generated tokens, EOS excluded
        self._n = 0  # tokens generated so far, EOS included
        self._score = 0.0
        self._reason: str | None = None
        self.logprobs = None if logprobs is None else int(logprobs)
        # one entry per generated token (EOS excluded), aligned with `generated`; None when not recording
        self._logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        # below GREEDY_TEMPERATURE, sampling is greedy (as vLLM): logits / 1e-300 overflow to inf and NaN
        self.temperature = 0.0 if temperature < GREEDY_TEMPERATURE else float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.constraint = constraint
        # this request's own random generator (sampling only): one uniform draw per step
        self.generator = np.random.default_rng(seed) if self.temperature > 0.0 else None
        self._seen: np.ndarray | None = None  # (V,) bool: tokens in prefix + generated, built on the first step
        # (V,) int64: how often each token was generated (prefix excluded), built on the first step; None when the
        # OpenAI penalties are off
        self._counts: np.ndarray | None = None
        # every choice is processed (sampling, penalties); else only while a ban applies
        self.always_processed = bool(self.temperature > 0.0 or self.repetition_penalty != 1.0
                                     or self.presence_penalty or self.frequency_penalty)

    @property
    def num_rows(self) -> int:
        return 0 if self._reason is not None else 1

    @property
    def done(self) -> bool:
        return self._reason is not None

    @property
    def generated(self) -> np.ndarray:
        """Tokens generated so far, EOS excluded (a view, shape (n,))."""
        return self._tokens[: self._n - (self._reason == "eos")]

    @property
    def token_logprobs(self) -> list[TokenLogprob]:
        """Recorded log-probs, ``token_logprobs[i]`` for ``generated[i]`` (same length at every step; empty when
        ``logprobs`` is None). The live list, not a copy: read it, do not mutate it."""
        return self._logprobs if self._logprobs is not None else []

    # --- the row state the sampler reads (`step_single_rows` gathers it) ----------------------------------------

    def needs_processing(self) -> bool:
        """Whether the next choice is more than the argmax of the raw logits."""
        if self._forced.pending:  # a forced step emits its token whatever the logits say
            return False
        return (self.always_processed or self.constraint is not None
                or (self._n < self.min_new_tokens and bool(self._eos_set))
                or (self._ngrams is not None and bool(self._ngrams.banned())))

    def mask_banned(self, banned: np.ndarray) -> None:
        """In place on a ban mask (V,) bool: True for the tokens that would repeat an n-gram
        (``no_repeat_ngram_size``), and for EOS while fewer than ``min_new_tokens`` tokens were generated."""
        if self._ngrams is not None and self._ngrams.banned():
            banned[self._ngrams.banned_ids(banned.shape[-1])] = True
        if self._n < self.min_new_tokens and self.eos.size:
            banned[self.eos] = True
        if self.constraint is not None:
            self.constraint.ban(banned)

    def bans(self, token: int) -> bool:
        """Whether `mask_banned` bans ``token`` (an id of the vocabulary), without building the mask."""
        if self._n < self.min_new_tokens and token in self._eos_set:
            return True
        if self.constraint is not None and self.constraint.bans(token):
            return True
        return self._ngrams is not None and token in self._ngrams.banned()

    def seen_tokens(self, vocab: int) -> np.ndarray:
        """(V,) bool: the tokens of prefix + generated so far (the repetition penalty's set), built on first use."""
        if self._seen is None:
            self._seen = np.zeros(vocab, dtype=bool)
            self._seen[self._prefix[(self._prefix >= 0) & (self._prefix < vocab)]] = True
        return self._seen

    def token_counts(self, vocab: int) -> np.ndarray:
        """(V,) int64: how often each token was generated (prefix excluded), built on first use."""
        if self._counts is None:
            self._counts = np.zeros(vocab, dtype=np.int64)
        return self._counts

    def process_logits(self, row: np.ndarray) -> np.ndarray:
        """Raw logits (V,) -> processed logits (V,) for the next draw (-inf = removed), given the tokens so far."""
        x = np.array(row, dtype=np.float64)[None, :]
        return sampler.process(x, row_params([self], x.shape[1]))[0]

    # --- one step ------------------------------------------------------------------------------------------------

    def step(self, logits: np.ndarray) -> StepResult:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise ValueError(f"expected logits of shape (1, V), got {logits.shape}")
        return step_single_rows([self], logits)[0]

    def accept(self, tok: int, lp: float, top: list[tuple[int, float]]) -> StepResult:
        """Record the chosen token ``tok``, its raw log-probability ``lp`` and the top alternatives ``top`` (read
        only for ``logprobs``); decides whether the sequence ends."""
        if self._forced.pending:  # a forced step: ``tok`` is not used, nothing is recorded
            return self._forced.emit()
        if self._seen is not None:
            self._seen[tok] = True
        if self._counts is not None:  # an EOS is counted too, but it ends the sequence
            self._counts[tok] += 1
        self._score += lp
        self._n += 1
        complete = self.constraint is not None and self.constraint.advance(tok)
        if tok in self._eos_set:
            self._reason = "eos"
        else:
            self._tokens[self._n - 1] = tok
            if self._logprobs is not None:  # before the stop check: aligned with `generated` at every step
                self._logprobs.append(TokenLogprob(tok, lp, top))
            if self._ngrams is not None:
                self._ngrams.append(tok)
            if complete or (self.stop_checker is not None and self.stop_checker(self._tokens[: self._n])):
                self._reason = "stop"
            elif self._n >= self.max_new_tokens:
                self._reason = "length"
        if self._reason is not None:
            return finished_step()
        return StepResult(tokens=np.array([tok], dtype=np.int64), parents=_ZERO, done=False)

    def results(self) -> list[Hypothesis]:
        if self._reason is None:
            raise RuntimeError("results() before the search is done")
        logprobs = None if self._logprobs is None else list(self._logprobs)
        return [Hypothesis(tokens=self.generated.tolist(), score=self._score, finish_reason=self._reason,
                           logprobs=logprobs)]


def row_params(searches: Sequence[SamplingSearch], vocab: int) -> sampler.RowParams:
    """The sampler's view of `searches` (one row each): their parameters and state as arrays."""
    banned = np.zeros((len(searches), vocab), dtype=bool)
    for row, search in enumerate(searches):
        search.mask_banned(banned[row])
    return sampler.RowParams(
        temperature=np.array([s.temperature for s in searches]),
        top_k=np.array([s.top_k for s in searches], dtype=np.int64),
        top_p=np.array([s.top_p for s in searches]),
        repetition_penalty=np.array([s.repetition_penalty for s in searches]),
        presence_penalty=np.array([s.presence_penalty for s in searches]),
        frequency_penalty=np.array([s.frequency_penalty for s in searches]),
        seen=[s.seen_tokens(vocab) if s.repetition_penalty != 1.0 else None for s in searches],
        counts=[s.token_counts(vocab) if s.presence_penalty or s.frequency_penalty else None for s in searches],
        banned=banned,
        generators=[s.generator for s in searches],
    )


def step_single_rows(searches: Sequence[SamplingSearch], logits: np.ndarray, isolate: bool = False
                     ) -> list[StepResult | Exception]:
    """One step of single-row searches: `logits` (len(searches), V), row i for searches[i].

    ``isolate``: a search that raises gets its exception in its place in the result and the others go on (a
    failure in the shared array work is retried one row at a time, so that it concerns only the rows that
    cause it); otherwise the first exception propagates."""
    x = np.asarray(logits)  # read only: the rows to process are copied to float64 (`_choose`)
    if x.ndim != 2 or x.shape[0] != len(searches):
        raise ValueError(f"expected logits of shape ({len(searches)}, V), got {x.shape}")
    if any(s.done for s in searches):
        raise RuntimeError("step() called on a finished search")
    # every constrained row's allowed tokens at once, for the rows that need a full mask (sampling, penalties): a
    # greedy row asks of its raw argmax alone (`RowConstraint.bans`)
    constrained = [s.constraint for s in searches if s.constraint is not None and s.always_processed]
    if constrained:
        allow_rows(constrained, x.shape[1])
    if not isolate:
        return [search.accept(*chosen) for search, chosen in zip(searches, _choose(searches, x))]
    try:
        chosen = _choose(searches, x)
    except Exception:
        if len(searches) == 1:
            raise
        return [isolated(_step_one, search, x[row]) for row, search in enumerate(searches)]
    return [isolated(search.accept, *c) for search, c in zip(searches, chosen)]


def _step_one(search: SamplingSearch, row: np.ndarray) -> StepResult:
    return search.accept(*_choose([search], row[None, :].copy())[0])


def _choose(searches: Sequence[SamplingSearch], x: np.ndarray) -> list[tuple[int, float, list]]:
    """`accept`'s arguments for each row of raw logits ``x`` (float32 or float64, left as is): the token, its raw
    log-probability (the same float64 operations as `log_softmax`, for all rows at once) and its top alternatives.
    Only the rows that need processing are copied, to float64; the argmax of the others is the same in either
    dtype (float32 -> float64 is exact)."""
    peak, log_z = log_normaliser(x)
    processed = [i for i, s in enumerate(searches) if s.needs_processing()]
    tokens = np.argmax(x, axis=1) if len(processed) < len(searches) else np.empty(len(searches), np.int64)
    if processed:
        _choose_processed(searches, x, processed, tokens)
    logprobs = ((x[np.arange(len(tokens)), tokens] - peak) - log_z).tolist()
    if all(s.logprobs is None for s in searches):  # nothing recorded (the usual case): `top` is never read
        return list(zip(tokens.tolist(), logprobs, [NOT_RECORDED] * len(searches)))
    return [(tok, lp, top_logprobs(x[row], s.logprobs, peak[row], log_z[row]) if s.logprobs else [])
            for row, (s, tok, lp) in enumerate(zip(searches, tokens.tolist(), logprobs))]


def _choose_processed(searches: Sequence[SamplingSearch], x: np.ndarray, processed: list[int],
                      tokens: np.ndarray) -> None:
    """Into ``tokens``: the choices of the rows ``processed`` (those more than the argmax of their raw logits)."""
    # greedy rows whose only processing is a ban (min_new_tokens' EOS, the n-gram ban): the argmax of the logits
    # with the banned tokens at -inf, what the sampler would choose, without its arrays of every parameter
    banned_only = [i for i in processed if not searches[i].always_processed]
    if banned_only:
        # the argmax of a row with its banned tokens at -inf is the argmax of the raw row unless that token is banned
        # (the first maximum overall is then the first among the allowed ones too): a mask only for the rows whose
        # raw choice is banned (min_new_tokens' EOS is rarely the most likely token)
        chosen = np.argmax(x[banned_only], axis=1)
        hit = [row for row, (i, token) in enumerate(zip(banned_only, chosen.tolist())) if searches[i].bans(token)]
        if hit:
            rows = [banned_only[row] for row in hit]
            banned = np.zeros((len(rows), x.shape[1]), dtype=bool)
            for mask, i in zip(banned, rows):
                searches[i].mask_banned(mask)
            chosen[hit] = np.argmax(np.where(banned, -np.inf, x[rows]), axis=1)
        tokens[banned_only] = chosen
        processed = [i for i in processed if searches[i].always_processed]
    if processed:
        tokens[processed] = sampler.choose(x[processed].astype(np.float64, copy=False),
                                           row_params([searches[i] for i in processed], x.shape[1]))
