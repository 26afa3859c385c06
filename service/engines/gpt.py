"""GPT engine: prompt pass (prefill) and one-token decoding steps over a `KVCache`, on ONNX Runtime.

One graph serves both: prefill feeds the right-padded prompts with an empty cache, each step feeds one token per
row with the cache. Rows of different lengths share a batch through explicit positions and the slot mask.
A version with an in-place step graph (config `files["decoder_step"]`, `export.kv_inplace`) runs the steps on
it instead: the cache becomes fixed-capacity buffers, bound through IO binding as the graph's past and present,
so a step writes its slot without copying the past; a `+gqa` step's take the context length at once (`limit`).

The prompt pass returns the logits at every prompt position, so prompt log-probabilities (OpenAI's `echo` +
`logprobs`, vLLM's `prompt_logprobs`) need no second pass (`prefill_positions`). A decoder graph whose logits held
the last position only could neither score prompts nor end right-padded ones: `scores_prompts` is False and its
prompt pass raises rather than return another position's logits.

Design notes: docs/architecture.md, service/engines/gpt.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from service.decoding import Search, run_search
from service.decoding.constraints import ConstraintCompiler
from service.engines import onnx_schema as schema
from service.engines.device_cache import DeviceKVCache
from service.engines.device_ops import past_dtype
from service.engines.iobinding import HostTransfers, host_bytes, run_bound, step_runners
from service.engines.kv_cache import KVCache
from service.engines.kv_quantization import load_scales, quantize
from service.engines.prefix_cache import BLOCK_TOKENS, PrefixCache
from service.engines.prefix_pass import prefill_with_cache, suffix_exact
from service.engines.runtime import (EngineCalls, OneThreadSession, RuntimeOptions, active_provider, create_session,
                                     device_ops_for)
from service.engines.vocabulary import check_vocabulary, graphs_of
from service.engines.speculation import Verification, verify_drafts
from service.engines.weights import changes_step_attention, quantizes_kv_cache
from service.repository import TOKENIZER_FILE, ModelVersion


class PromptResult(NamedTuple):
    """A prompt pass: next-token logits (rows, V), the cache, the logits at every position of the rows asked for,
    and how many of each prompt's tokens a prefix cache held."""

    logits: np.ndarray
    cache: KVCache | DeviceKVCache
    every: dict[int, np.ndarray]
    cached_tokens: list[int]


class GPTEngine:
    def __init__(self, model: ModelVersion, options: RuntimeOptions = RuntimeOptions()):
        config = model.config
        self.model = model
        self.tokenizer = Tokenizer.from_file(str(model.path / TOKENIZER_FILE))
        self.session = create_session(model.path / config["files"]["decoder"], options)
        self.provider = active_provider(self.session)
        step_file = config["files"].get("decoder_step")
        arch = config["architecture"]
        self.n_layers, self.n_heads, self.head_dim = arch["n_layers"], arch["n_heads"], arch["head_dim"]
        self.vocab_size = arch["vocab_size"]
        # the in-place step graph (`export.kv_inplace`) when the version has one, else the small steps' session of
        # decoder.onnx (`OneThreadSession`)
        calls = EngineCalls()  # every ONNX Runtime call of this engine, whichever session (`OneThreadSession`)
        self.transfers = HostTransfers()  # what the steps bind in host memory (the KV cache's bytes: none on device)
        self._in_place, self._one_thread = step_runners(model.path, step_file, config["files"]["decoder"],
                                                        self.session, self.vocab_size, options, calls=calls,
                                                        transfers=self.transfers)
        # the prompt pass: every thread alone, one beside another worker's call; the concatenating graph's steps
        # share its session
        self._prompt_one_thread = self._one_thread or OneThreadSession.beside_others(
            model.path / config["files"]["decoder"], options, self.session, calls)
        self.context_length = config["context_length"]
        # GroupQueryAttention reads each row's used slots only: its caches take the context length at once
        # (`KVCache.limit`); the masked kernel reads the whole buffer, whose headroom stays small
        self.cache_limit = self.context_length if changes_step_attention(options.weights) else None
        # an int8 step cache (`+gqa+kv8`): the prompt pass's float32 presents are quantised into it
        self.kv_scales = load_scales(model.path) if self._in_place is not None and quantizes_kv_cache(
            options.weights) else None
        # the KV cache in the provider's memory (`service.engines.device_cache`; an int8 cache is quantised on the
        # host, so it stays there) or numpy on the host
        self._ops = None if self.kv_scales is not None else device_ops_for(self.session, options)
        self.kv_residence = "host" if self._ops is None else "device"
        self._kv_dtype = past_dtype(self.session)
        self.eos_id = config["special_tokens"]["eos_id"]
        self.pad_id = schema.PAD_ID  # the GPT config names none
        check_vocabulary(self.tokenizer, self.vocab_size, graphs_of(config["files"], self.session, self._in_place),
                         {"eos_id": self.eos_id})
        self.scores_prompts = returns_every_position(self.session)
        self.prefix_cache, self.prefix_caching = self._prefix_cache(options.prefix_cache_bytes)
        # output constraints over this tokenizer (`service.decoding.constraints`), compiled once each
        self.constraints = ConstraintCompiler(model.path / TOKENIZER_FILE, self.vocab_size, [self.eos_id])

    def _prefix_cache(self, budget: int) -> tuple[PrefixCache | None, dict]:
        """The prefix cache (`service.engines.prefix_cache`) and its report for `/v1/models`: none when `budget`
        is 0, for a cache on the device (not built there yet), for a graph that returns the last position only,
        or when this host's suffix pass differs from the whole prompt's (`suffix_exact`)."""
        report = {"enabled": False, "block_tokens": BLOCK_TOKENS, "budget_bytes": budget}
        if budget <= 0:
            return None, {**report, "reason": "turned off (TSERVE_PREFIX_CACHE)"}
        if self._ops is not None:
            return None, {**report, "reason": "not built for a KV cache on the device yet"}
        if not self.scores_prompts:
            return None, {**report, "reason": "the decoder graph returns the last position's logits only"}
        differs = suffix_exact(self._prompt_pass, self.vocab_size, self.context_length)
        if differs is not None:
            return None, {**report, "reason": differs}
        return PrefixCache(budget), {**report, "enabled": True}

    def reserve_prefix_cache(self) -> None:
        """Take the prefix cache's memory now (the engine that serves, at warm-up; not the variants timed at load):
        otherwise the first requests' blocks pay for fresh pages."""
        if self.prefix_cache is not None:
            self.prefix_cache.reserve(self.n_layers, self.n_heads, self.head_dim, self.vocab_size)

    def _empty_cache(self, rows: int) -> KVCache | DeviceKVCache:
        if self._ops is None:
            return KVCache.empty(rows, self.n_layers, self.n_heads, self.head_dim, self.cache_limit)
        return DeviceKVCache.empty(rows, self.n_layers, self.n_heads, self.head_dim, self._kv_dtype, self._ops,
                                   self.cache_limit)

    def _pass(self, session, cache: KVCache | DeviceKVCache, feeds: dict[str, np.ndarray], step: bool = False
              ) -> tuple[np.ndarray, list]:
        """One run of the concatenating graph over `cache`'s past -> (logits, presents): numpy on the host, or,
        for a device cache, the presents left on the device (only the logits cross). `step`: counted in
        `transfers`."""
        if self._ops is not None:
            presents = [name for i in range(self.n_layers) for name in schema.present_names(i)]
            (logits,), presents = run_bound(session, feeds, cache.feeds(), [schema.LOGITS], presents,
                                            self._ops.placement, self.transfers if step else None)
            return logits, presents
        past = cache.feeds()
        logits, *presents = session.run(None, {**feeds, **past})
        if step:
            self.transfers.add(host_bytes(past.values()), host_bytes((*feeds.values(), logits)))
        return logits, presents

    def _run(self, cache: KVCache | DeviceKVCache, ids: np.ndarray, positions: np.ndarray, new_mask: np.ndarray
             ) -> np.ndarray:
        """Feed one token per row, ids (R, 1) at positions (R, 1), after the cache; returns the logits (R, V)."""
        feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: positions,
                 schema.ATTENTION_MASK: np.concatenate([cache.mask, new_mask], axis=1)}
        with self._one_thread.call(ids.shape[0], self.session) as session:
            logits, presents = self._pass(session, cache, feeds, step=True)
        cache.append(presents, new_mask, positions[:, -1] + 1)
        return logits[:, -1]

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, KVCache]:
        """Run the prompts (right-padded to a common length: each row's tokens from slot 0, where they are alone,
        so that its logits do not depend on the batch, `service.engines.kv_cache`) -> logits at each prompt's last token
        (B, V) and the cache holding the prompts."""
        last, cache, _, _ = self.prefill_cached(prompts, ())
        return last, cache

    def prefill_positions(self, prompts: Sequence[Sequence[int]], rows: Collection[int]
                          ) -> tuple[np.ndarray, KVCache, dict[int, np.ndarray]]:
        """`prefill`, and for the prompts `rows` (indices into `prompts`) the logits at every one of their
        positions, row -> (len(prompt), V) float32: position t's are those of the token after prompt[: t + 1].
        Same pass, same numbers: the other rows pay nothing."""
        last, cache, every, _ = self.prefill_cached(prompts, rows)
        return last, cache, every

    def prefill_cached(self, prompts: Sequence[Sequence[int]], rows: Collection[int] = ()) -> PromptResult:
        """`prefill_positions`, each prompt starting from its longest cached prefix when the engine keeps a prefix
        cache (`service.engines.prefix_pass`: the same numbers as without), and how many of each prompt's tokens
        came from it (all 0 without one)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest > self.context_length:
            raise ValueError(f"prompt of {longest} tokens exceeds the context length {self.context_length}")
        done = prefill_with_cache(prompts, rows, self._prompt_pass, self.prefix_cache)
        presents = done.presents if self.kv_scales is None else quantize(done.presents, self.kv_scales)
        cache = self._empty_cache(len(prompts))
        cache.append(presents, done.mask, done.lengths)
        return PromptResult(done.last, cache, done.every, done.cached_tokens)

    def _prompt_pass(self, prompts: Sequence[Sequence[int]], past: list[np.ndarray] | None = None
                     ) -> tuple[np.ndarray, list]:
        """One pass of the prompt graph over `prompts`, right-padded, after `past` (flat K/V of as many slots for
        every row, positions 0 onwards; None: from the start) -> logits at every new position (rows, longest, V)
        and the presents (past and new slots)."""
        rows, longest = len(prompts), max(len(p) for p in prompts)
        start = 0 if past is None else past[0].shape[2]
        lengths = np.array([len(p) for p in prompts], np.int64)
        ids = np.full((rows, longest), self.pad_id, np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
        new_mask = (np.arange(longest) < lengths[:, None]).astype(np.int64)
        positions = np.where(new_mask == 1, start + np.arange(longest), 0)
        if past is None:
            cache = self._empty_cache(rows)
        else:
            cache = KVCache(list(past[0::2]), list(past[1::2]), np.ones((rows, start), np.int64),
                            np.full(rows, start, np.int64))
        feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: positions,
                 schema.ATTENTION_MASK: np.concatenate([cache.mask, new_mask], axis=1)}
        with self._prompt_one_thread.call(ids.size, self.session) as session:
            logits, presents = self._pass(session, cache, feeds)
        if logits.shape[1] != longest:  # right-padded rows end at different positions: each needs its own
            raise ValueError(f"the decoder graph returned logits for {logits.shape[1]} of the {longest} prompt "
                             "positions: it cannot score prompts nor end right-padded ones")
        return logits, presents

    def step(self, cache: KVCache, tokens: np.ndarray) -> np.ndarray:
        """Append one token per row (R,) and return the next-token logits (R, V)."""
        R = cache.rows
        if int(cache.positions.max(initial=0)) >= self.context_length:
            raise ValueError(f"a row reached the context length {self.context_length}")
        if self._in_place is not None:
            return self._in_place.run(cache, tokens.reshape(R))  # written into its bound int64 ids
        ids = tokens.reshape(R, 1).astype(np.int64)
        return self._run(cache, ids, cache.positions.reshape(R, 1), np.ones((R, 1), np.int64))

    @property
    def speculates(self) -> bool:
        """Whether `verify` can check draft tokens over this engine's caches: float ones on the host (an int8
        cache, `+kv8`, or one in a device's memory is not verified, `service.engines.speculation`)."""
        return self._ops is None and self.kv_scales is None and self.scores_prompts

    def verify(self, cache: KVCache, fed: Sequence[Sequence[int]]) -> Verification:
        """One pass of the prompt graph feeding each row its pending token and its draft, `fed[row]`, after the
        cache -> the logits at each fed position; `Verification.commit(kept)` keeps the accepted tokens."""

        def run(feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, list]:
            # on the one-thread session where there is one (`call` of 0 rows): 1.1-1.5x faster than both threads
            # for up to 8 rows of 2 to 9 tokens (docs/speculation.md)
            with self._prompt_one_thread.call(0, self.session) as session:
                logits, *presents = session.run(None, feeds)
            return logits, presents

        return verify_drafts(cache, fed, run, self.pad_id, self.context_length)

    @staticmethod
    def select(cache: KVCache | DeviceKVCache, rows: np.ndarray) -> KVCache | DeviceKVCache:
        cache.select(rows)
        return cache

    @staticmethod
    def recycle(cache: KVCache | DeviceKVCache, rows: np.ndarray) -> None:
        cache.recycle(rows)

    @staticmethod
    def concatenate(caches: Sequence[KVCache | DeviceKVCache], rows: Sequence[np.ndarray | None] | None = None
                    ) -> KVCache | DeviceKVCache:
        """Stack (selected rows of) several caches; the first is consumed: its buffers take the others' rows when
        they have room (`KVCache.concatenate`'s `in_place`)."""
        return type(caches[0]).concatenate(caches, rows=rows, in_place=True)

    def generate(self, prompts: Sequence[Sequence[int]], make_search: Callable[[int], Search]) -> list[Search]:
        """Decode a batch offline: prefill, then steps until every search is done (see `run_search`)."""
        logits, cache = self.prefill(prompts)
        searches = [make_search(i) for i in range(len(prompts))]

        def step_fn(tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
            cache.select(parents)
            return self.step(cache, tokens)

        run_search(searches, list(logits), step_fn)
        return searches


def returns_every_position(session) -> bool:
    """Whether a decoder graph's logits have a position axis that follows its input (rows, positions, V), as the
    exported GPT's do; a graph that keeps the last position only (a fixed length of 1, or no position axis)
    cannot score prompts."""
    logits = next(o for o in session.get_outputs() if o.name == schema.LOGITS)
    return len(logits.shape) == 3 and logits.shape[1] != 1
