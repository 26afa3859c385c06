"""Translation engine: encoder pass once per source, then one-token decoder steps over a `KVCache`.

The encoder graph returns each decoder layer's cross-attention keys/values; they are kept once per source in
`EncodedSources`, and every decoding row (a beam, or a request's single greedy row) points at its source through
the cache's `encoder_row`: beams share their source's keys/values by index, nothing is recomputed per beam or step.
A version with an in-place step graph (config `files["decoder_step"]`, `export.kv_inplace`) runs every decoder
call on it: the cache is fixed-capacity buffers, bound through IO binding as the graph's past and present, so a
step writes its slot without copying the past.

`score_ids` is forced decoding (CTranslate2's `Translator.score_batch`): the log-probability of given targets, one
encoder pass for the sources and one teacher-forced decoder pass over every target position at once (the decoder
graph builds its causal mask for however many tokens it is fed), or, on a version whose only decoder is the
in-place step graph (one token per row), one step per target position for all the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from service.decoding import Search, run_search
from service.decoding.types import StepLogits, row_candidates
from service.decoding.distributions import log_normaliser
from service.engines import onnx_schema as schema
from service.engines.device_cache import DeviceKVCache
from service.engines.device_ops import past_dtype
from service.engines.encoded_sources import DecoderBatch, EncodedSources
from service.engines.iobinding import HostTransfers, host_bytes, run_bound, step_runners
from service.engines.kv_cache import KVCache
from service.engines.runtime import (EngineCalls, OneThreadSession, RuntimeOptions, active_provider, create_session,
                                     device_ops_for)
from service.engines.vocabulary import check_vocabulary, graphs_of
from service.repository import TOKENIZER_FILE, ModelVersion

DEFAULT_LENGTH_PENALTY = 1.0  # beam search's, for a version whose config.json does not choose one (transformers')
# A request that sets no max_new_tokens gets TARGET_PER_SOURCE_TOKEN tokens per source token plus
# TARGET_SLACK_TOKENS (within the positional table): room for a translation up to twice as long as its source, and
# a few tokens more for short sources, whose translations vary most in length, while a row that never emits EOS
# still ends.
TARGET_PER_SOURCE_TOKEN = 2
TARGET_SLACK_TOKENS = 10
# The most logits (rows x target positions x vocabulary, float32) one teacher-forced decoder pass of `score_ids`
# returns, 64 MiB: 32 targets of 64 tokens at the released vocabulary of 8,000 in one pass; a batch of longer
# targets is scored in as many passes (of fewer rows each) as this takes.
SCORE_PASS_LOGITS = 2**24
# Sources that no row attends to any more (their searches are done) are dropped from a batch's encoded sources once
# they are at least this fraction of them: the decoder gathers each row's source by index, so an unused source
# costs memory, not time, while dropping copies every kept source's cross-attention keys and values (a beam batch
# loses a source at most steps near its end).
UNUSED_SOURCES_DROPPED = 0.5


class TranslationEngine:
    # prefill and step take `candidates` and return `StepLogits` (`service.scheduling.text_batch.DecodingBackend`)
    returns_row_candidates = True

    def __init__(self, model: ModelVersion, options: RuntimeOptions = RuntimeOptions()):
        config = model.config
        self.model = model
        self.tokenizer = Tokenizer.from_file(str(model.path / TOKENIZER_FILE))
        self.encoder = create_session(model.path / config["files"]["encoder"], options)
        # decoding only ever feeds one token per row (the start token, then steps), so a version with an in-place
        # step graph needs no other decoder graph (`export.kv_inplace`: it replaces decoder.onnx); `score_ids`
        # feeds whole targets to this one when there is one, and steps through the step graph otherwise
        decoder_file = config["files"].get("decoder")
        # the decoder graphs return each row's most likely tokens beside its logits, for the beam searches
        # (`service.engines.row_candidates`)
        self.decoder = (create_session(model.path / decoder_file, options, row_candidates=True) if decoder_file
                        else None)
        self.provider = active_provider(self.encoder)
        step_file = config["files"].get("decoder_step")
        if not (decoder_file or step_file):
            raise ValueError(f"{model.path}: config.json names no decoder graph (files.decoder or files.decoder_step)")
        arch = config["architecture"]
        self.n_layers, self.n_heads, self.head_dim = arch["n_decoder_layers"], arch["n_heads"], arch["head_dim"]
        self.vocab_size = arch["vocab_size"]
        # what a step reads from the decoder graph, in this order
        self._outputs = [schema.LOGITS, *(name for i in range(self.n_layers) for name in schema.present_names(i)),
                         schema.TOP_LOGPROBS, schema.TOP_IDS]
        # the in-place step graph (`export.kv_inplace`) when the version has one: every decoder call runs on it;
        # else the small steps' session of decoder.onnx (`OneThreadSession`)
        calls = EngineCalls()  # every ONNX Runtime call of this engine, whichever session (`OneThreadSession`)
        self.transfers = HostTransfers()  # what the steps bind in host memory (the KV cache's bytes: none on device)
        self._in_place, self._one_thread = step_runners(model.path, step_file, decoder_file, self.decoder,
                                                        self.vocab_size, options, row_candidates=True, calls=calls,
                                                        transfers=self.transfers)
        # the KV cache and the encoded sources in the provider's memory (`service.engines.device_cache`), or numpy
        # on the host
        step_graph = self.decoder if self.decoder is not None else self._in_place.session
        self._ops = device_ops_for(step_graph, options)
        self.kv_residence = "host" if self._ops is None else "device"
        self._kv_dtype = past_dtype(step_graph)
        # the encoder pass: every thread alone, one beside another worker's call
        self._encoder_one_thread = OneThreadSession.beside_others(model.path / config["files"]["encoder"], options,
                                                                  self.encoder, calls)
        special = config["special_tokens"]
        self.pad_id, self.bos_id, self.eos_id = special["pad_id"], special["bos_id"], special["eos_id"]
        check_vocabulary(self.tokenizer, self.vocab_size, graphs_of(config["files"], self.decoder, self._in_place),
                         {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id})
        self.max_source_length = config["max_source_length"]
        self.max_target_length = config["max_target_length"]
        # beam search's default length penalty: the one chosen on validation (export, from models.evaluate)
        self.length_penalty = float(config.get("generation", {}).get("length_penalty", DEFAULT_LENGTH_PENALTY))

    def source_ids(self, text: str) -> list[int]:
        """Tokenise a German sentence: ids + EOS, all of them (never cut: `encode` refuses a source longer than
        `max_source_length`, which the serving layer checks first, `service.serving.translate.source_ids`)."""
        return self.tokenizer.encode(text).ids + [self.eos_id]

    def encode(self, sources: Sequence[Sequence[int]], on_device: bool = True) -> EncodedSources:
        """The encoder pass: the sources' cross-attention keys/values, left on the device when the KV cache lives
        there (and `on_device`: the scoring routes feed them to `session.run` as numpy)."""
        length = max(len(s) for s in sources)
        if length > self.max_source_length:
            raise ValueError(f"source of {length} tokens exceeds {self.max_source_length}")
        ids = np.full((len(sources), length), self.pad_id, np.int64)
        mask = np.zeros((len(sources), length), np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
            mask[row, : len(source)] = 1
        feeds = {schema.INPUT_IDS: ids, schema.ATTENTION_MASK: mask}
        with self._encoder_one_thread.call(ids.size, self.encoder) as session:
            if self._ops is None or not on_device:
                return EncodedSources(session.run(None, feeds), mask)
            _, cross = run_bound(session, feeds, {}, [], [o.name for o in session.get_outputs()], self._ops.placement)
        return EncodedSources(cross, mask, self._ops)

    def _run(self, cache: KVCache | DeviceKVCache, encoded: EncodedSources, tokens: np.ndarray, candidates: int = 0
             ) -> np.ndarray | StepLogits:
        """One token per row (R,) -> the next-token logits (R, V), or with ``candidates`` a `StepLogits` that also
        holds each row's that many most likely tokens."""
        if self._in_place is not None:
            step = self._in_place.run(cache, tokens, {schema.ENCODER_ATTENTION_MASK: encoded.mask,
                                                      schema.ENCODER_ROW: cache.encoder_row,
                                                      **self._cross_feeds(encoded)}, candidates)
            return step if candidates else step.logits
        R = cache.rows
        new_mask = np.ones((R, 1), np.int64)
        feeds = {
            schema.INPUT_IDS: tokens.reshape(R, 1).astype(np.int64),
            schema.POSITION_IDS: cache.positions.reshape(R, 1),
            schema.ATTENTION_MASK: np.concatenate([cache.mask, new_mask], axis=1),
            schema.ENCODER_ATTENTION_MASK: encoded.mask,
            schema.ENCODER_ROW: cache.encoder_row,
            schema.CANDIDATES_K: np.array([candidates], np.int64),
        }
        with self._one_thread.call(R, self.decoder) as session:
            if isinstance(cache, DeviceKVCache):  # the past and the sources on the device, the presents left there
                (logits, top_logprobs, top_ids), presents = run_bound(
                    session, feeds, {**cache.feeds(), **self._cross_feeds(encoded)},
                    [schema.LOGITS, schema.TOP_LOGPROBS, schema.TOP_IDS], self._outputs[1:-2], self._ops.placement,
                    self.transfers)
            else:
                past = cache.feeds()
                logits, *presents, top_logprobs, top_ids = session.run(
                    self._outputs, {**feeds, **past, **self._cross_feeds(encoded)})
                self.transfers.add(host_bytes(past.values()), host_bytes((*feeds.values(), *encoded.cross, logits,
                                                                          top_logprobs, top_ids)))
        cache.append(presents, new_mask, cache.positions + 1)
        if not candidates:
            return logits[:, -1]
        return StepLogits(logits[:, -1], top_logprobs[:, -1], top_ids[:, -1])

    def _cross_feeds(self, encoded: EncodedSources) -> dict[str, np.ndarray]:
        """The decoder's cross-attention inputs: every layer's keys and values of the encoded sources."""
        return {name: array for i in range(self.n_layers)
                for name, array in zip(schema.cross_names(i), encoded.cross[2 * i : 2 * i + 2])}

    def start(self, encoded: EncodedSources, candidates: int = 0) -> tuple[np.ndarray | StepLogits, DecoderBatch]:
        """Feed the decoder start token for every source -> first logits (N, V) (with ``candidates``, a
        `StepLogits` with each row's that many most likely tokens), and a batch of one row each."""
        if encoded.ops is None:
            cache = KVCache.empty(encoded.count, self.n_layers, self.n_heads, self.head_dim)
        else:
            cache = DeviceKVCache.empty(encoded.count, self.n_layers, self.n_heads, self.head_dim, self._kv_dtype,
                                        encoded.ops)
        cache.encoder_row = np.arange(encoded.count, dtype=np.int64)
        tokens = np.full(encoded.count, self.bos_id, np.int64)
        return self._run(cache, encoded, tokens, candidates), DecoderBatch(cache, encoded)

    def prefill(self, sources: Sequence[Sequence[int]], candidates: int = 0
                ) -> tuple[np.ndarray | StepLogits, DecoderBatch]:
        """Encoder pass + decoder start token: the prefill of the batching scheduler."""
        return self.start(self.encode(sources), candidates)

    def step(self, batch: DecoderBatch, tokens: np.ndarray, candidates: int = 0) -> np.ndarray | StepLogits:
        """Append one token per row (R,) -> the next-token logits (R, V), or with ``candidates`` a `StepLogits`
        that also holds each row's that many most likely tokens (what the beam searches choose among,
        `Search.row_candidates`)."""
        if int(batch.cache.positions.max(initial=0)) >= self.max_target_length:
            raise ValueError(f"a row reached the longest target the model embeds ({self.max_target_length})")
        return self._run(batch.cache, batch.encoded, tokens, candidates)

    @staticmethod
    def select(batch: DecoderBatch, rows: np.ndarray) -> DecoderBatch:
        """Keep rows `rows`; once the sources no row attends to any more are `UNUSED_SOURCES_DROPPED` of them,
        they are dropped and the rows re-pointed."""
        batch.cache.select(rows)
        used = np.unique(batch.cache.encoder_row)
        if batch.encoded.count - len(used) >= UNUSED_SOURCES_DROPPED * batch.encoded.count:
            batch.encoded = batch.encoded.select(used)
            batch.cache.encoder_row = np.searchsorted(used, batch.cache.encoder_row).astype(np.int64)
        return batch

    @staticmethod
    def recycle(batch: DecoderBatch, rows: np.ndarray) -> None:
        batch.cache.recycle(rows)

    @staticmethod
    def concatenate(batches: Sequence[DecoderBatch], rows: Sequence[np.ndarray | None] | None = None
                    ) -> DecoderBatch:
        """Stack (selected rows of) several batches; sources no kept row uses go at the next `select`. The first
        batch's cache is consumed: its buffers take the others' rows when they have room (`KVCache.concatenate`'s
        `in_place`)."""
        encoded, offsets = EncodedSources.concatenate([b.encoded for b in batches])
        caches = [b.cache for b in batches]
        return DecoderBatch(type(caches[0]).concatenate(caches, offsets, rows, in_place=True), encoded)

    def default_max_new_tokens(self, source_length: int) -> int:
        """Room for a translation (`TARGET_PER_SOURCE_TOKEN`, `TARGET_SLACK_TOKENS`), within the positional table."""
        room = TARGET_PER_SOURCE_TOKEN * source_length + TARGET_SLACK_TOKENS
        return min(room, self.max_target_length - 1)  # the start token takes position 0

    def translate_ids(self, sources: Sequence[Sequence[int]], make_search: Callable[[int], Search]) -> list[Search]:
        """Decode a batch offline: encode once, start, then steps until every search is done."""
        searches = [make_search(i) for i in range(len(sources))]
        logits, batch = self.prefill(sources, row_candidates(searches))

        def step_fn(tokens: np.ndarray, parents: np.ndarray) -> np.ndarray | StepLogits:
            return self.step(self.select(batch, parents), tokens, row_candidates(searches))

        run_search(searches, logits, step_fn)
        return searches

    def score_ids(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                  source_rows: Sequence[int], before_run: Callable[[], None] = lambda: None) -> list[np.ndarray]:
        """Forced decoding: for each target (ids, no start token, EOS excluded), the log-probability of each of
        its tokens and then of EOS given the source `sources[source_rows[i]]` (source ids as `source_ids` makes
        them): one float64 array (len(target) + 1,) per target. The log-probabilities are those of the raw logits,
        as the searches' scores are (greedy decoding's score of its output is the sum of these).

        One encoder pass for the sources (a source several targets share is encoded once); then one
        teacher-forced decoder pass over every target position at once (rows in chunks of at most
        SCORE_PASS_LOGITS logits), or one step per position for all targets on a version whose only decoder is
        the in-place step graph. `before_run()` is called before every graph run: what it raises stops the work.
        """
        longest = max(len(t) for t in targets) + 1  # the start token, then every target token is fed
        if longest > self.max_target_length:
            raise ValueError(f"target of {longest - 1} tokens exceeds the {self.max_target_length - 1} the model "
                             f"embeds after its start token")
        before_run()
        encoded = self.encode(sources, on_device=False)
        rows = np.asarray(source_rows, np.int64)
        if self.decoder is None:
            return self._score_by_steps(encoded, targets, rows, before_run)
        per_pass = max(1, SCORE_PASS_LOGITS // (longest * self.vocab_size))
        scores: list[np.ndarray] = []
        for start in range(0, len(targets), per_pass):
            before_run()
            chunk = targets[start : start + per_pass]
            scores += self._score_in_one_pass(encoded, chunk, rows[start : start + per_pass])
        return scores

    def _forced_inputs(self, targets: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Teacher forcing's decoder inputs: the start token then each target, right-padded -> ids (R, T) and
        mask (R, T), T = the longest target + 1."""
        T = max(len(t) for t in targets) + 1
        ids = np.full((len(targets), T), self.pad_id, np.int64)
        mask = np.zeros((len(targets), T), np.int64)
        for row, target in enumerate(targets):
            ids[row, : len(target) + 1] = [self.bos_id, *target]
            mask[row, : len(target) + 1] = 1
        return ids, mask

    def _score_in_one_pass(self, encoded: EncodedSources, targets: Sequence[Sequence[int]],
                           rows: np.ndarray) -> list[np.ndarray]:
        """Every position of every target through the decoder graph at once, no past: logits (R, T, V). The
        padding after a target is masked and comes after its tokens, so it changes none of its logits."""
        ids, mask = self._forced_inputs(targets)
        R, T = ids.shape
        feeds = {
            schema.INPUT_IDS: ids,
            schema.POSITION_IDS: np.tile(np.arange(T, dtype=np.int64), (R, 1)),
            schema.ATTENTION_MASK: mask,
            schema.ENCODER_ATTENTION_MASK: encoded.mask,
            schema.ENCODER_ROW: rows,
            **KVCache.empty(R, self.n_layers, self.n_heads, self.head_dim).feeds(),
            **self._cross_feeds(encoded),
        }
        (logits,) = self.decoder.run([schema.LOGITS], feeds)  # (R, T, V)
        return [self._forced_logprobs(logits[row, : len(target) + 1], target)
                for row, target in enumerate(targets)]

    def _score_by_steps(self, encoded: EncodedSources, targets: Sequence[Sequence[int]], rows: np.ndarray,
                        before_run: Callable[[], None]) -> list[np.ndarray]:
        """Teacher forcing through the one-token step graph: step j feeds every row's input j (a row whose target
        has ended feeds padding, whose log-probabilities are dropped) and keeps the log-probability of its output
        j (the target token j, or EOS after the last one)."""
        ids, _ = self._forced_inputs(targets)
        R, T = ids.shape
        outputs = np.full((R, T), self.eos_id, np.int64)  # what each input predicts: the next token, then EOS
        outputs[:, :-1] = ids[:, 1:]
        for row, target in enumerate(targets):
            outputs[row, len(target)] = self.eos_id
        cache = KVCache.empty(R, self.n_layers, self.n_heads, self.head_dim)
        cache.encoder_row = rows
        logprobs = np.empty((R, T))
        for j in range(T):
            before_run()
            logits = self._run(cache, encoded, ids[:, j])  # (R, V)
            logprobs[:, j] = _logprobs_of(logits, outputs[:, j])
        return [logprobs[row, : len(target) + 1] for row, target in enumerate(targets)]

    def _forced_logprobs(self, logits: np.ndarray, target: Sequence[int]) -> np.ndarray:
        """The log-probability of each target token, then of EOS, from the logits (len + 1, V) fed before each."""
        return _logprobs_of(logits, np.array([*target, self.eos_id], np.int64))


def _logprobs_of(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log_softmax(logits)[i, tokens[i]] for logits (N, V), in float64 as the searches compute it -> (N,)."""
    peak, log_z = log_normaliser(logits)  # float64 terms, bit-identical for float32 logits
    return (logits[np.arange(len(tokens)), tokens].astype(np.float64) - peak) - log_z
