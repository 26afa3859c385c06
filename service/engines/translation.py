"""Translation engine: encoder pass once per source, then one-token decoder steps over a `KVCache`.

The encoder graph returns each decoder layer's cross-attention keys/values; they are kept once per source in
`EncodedSources`, and every decoding row (a beam, or a request's single greedy row) points at its source through
the cache's `encoder_row`: beams share their source's keys/values by index, nothing is recomputed per beam or step.
A version with an in-place step graph (config `files["decoder_step"]`, `export.kv_inplace`) runs every decoder
call on it: the cache is fixed-capacity buffers, bound through IO binding as the graph's past and present, so a
step writes its slot without copying the past.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from service.decoding import Search, run_search
from service.engines import onnx_schema as schema
from service.engines.iobinding import InPlaceStep
from service.engines.kv_cache import KVCache
from service.engines.runtime import RuntimeOptions, active_provider, create_session
from service.models.repository import TOKENIZER_FILE, ModelVersion

DEFAULT_LENGTH_PENALTY = 1.0  # beam search's, for a version whose config.json does not choose one (transformers')
# A request that sets no max_new_tokens gets TARGET_PER_SOURCE_TOKEN tokens per source token plus
# TARGET_SLACK_TOKENS (within the positional table): room for a translation up to twice as long as its source, and
# a few tokens more for short sources, whose translations vary most in length, while a row that never emits EOS
# still ends.
TARGET_PER_SOURCE_TOKEN = 2
TARGET_SLACK_TOKENS = 10


@dataclass
class EncodedSources:
    """Cross-attention K/V of a set of sources: flat [layer 0 key, layer 0 value, ...], each (N, H, S, Dh), and
    the source mask (N, S)."""

    cross: list[np.ndarray]
    mask: np.ndarray

    @property
    def count(self) -> int:
        return self.mask.shape[0]

    @staticmethod
    def concatenate(parts: Sequence[EncodedSources]) -> tuple[EncodedSources, list[int]]:
        """Stack sources (right-padding the source axis); returns the result and each part's first row."""
        length = max(p.mask.shape[1] for p in parts)
        offsets = list(np.cumsum([0] + [p.count for p in parts[:-1]]))

        def right_pad(array: np.ndarray, axis: int) -> np.ndarray:
            widths = [(0, 0)] * array.ndim
            widths[axis] = (0, length - array.shape[axis])
            return np.pad(array, widths) if widths[axis][1] else array

        cross = [np.concatenate([right_pad(p.cross[i], 2) for p in parts]) for i in range(len(parts[0].cross))]
        return EncodedSources(cross, np.concatenate([right_pad(p.mask, 1) for p in parts])), [int(o) for o in offsets]

    def select(self, sources: np.ndarray) -> EncodedSources:
        return EncodedSources([c[sources] for c in self.cross], self.mask[sources])


@dataclass
class DecoderBatch:
    """The decoding state of a batch: the self-attention cache of every row and the sources the rows attend to."""

    cache: KVCache
    encoded: EncodedSources

    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def positions(self) -> np.ndarray:
        return self.cache.positions


class TranslationEngine:
    def __init__(self, model: ModelVersion, options: RuntimeOptions = RuntimeOptions()):
        config = model.config
        self.model = model
        self.tokenizer = Tokenizer.from_file(str(model.path / TOKENIZER_FILE))
        self.encoder = create_session(model.path / config["files"]["encoder"], options)
        # the decoder is only ever fed one token per row (the start token, then steps), so a version with an
        # in-place step graph needs no other decoder graph (`export.kv_inplace`: it replaces decoder.onnx)
        decoder_file = config["files"].get("decoder")
        self.decoder = create_session(model.path / decoder_file, options) if decoder_file else None
        self.provider = active_provider(self.encoder)
        step_file = config["files"].get("decoder_step")
        if not (decoder_file or step_file):
            raise ValueError(f"{model.path}: config.json names no decoder graph (files.decoder or files.decoder_step)")
        arch = config["architecture"]
        self.n_layers, self.n_heads, self.head_dim = arch["n_decoder_layers"], arch["n_heads"], arch["head_dim"]
        self.vocab_size = arch["vocab_size"]
        # the in-place step graph (`export.kv_inplace`), when the version has one: every decoder call runs on it
        self._in_place = InPlaceStep(create_session(model.path / step_file, options), self.vocab_size) \
            if step_file else None
        special = config["special_tokens"]
        self.pad_id, self.bos_id, self.eos_id = special["pad_id"], special["bos_id"], special["eos_id"]
        self.max_source_length = config["max_source_length"]
        self.max_target_length = config["max_target_length"]
        # beam search's default length penalty: the one chosen on validation (export, from models.evaluate)
        self.length_penalty = float(config.get("generation", {}).get("length_penalty", DEFAULT_LENGTH_PENALTY))

    def source_ids(self, text: str) -> list[int]:
        """Tokenise a German sentence: ids + EOS, truncated to the longest source the model accepts."""
        ids = self.tokenizer.encode(text).ids[: self.max_source_length - 1]
        return ids + [self.eos_id]

    def encode(self, sources: Sequence[Sequence[int]]) -> EncodedSources:
        length = max(len(s) for s in sources)
        if length > self.max_source_length:
            raise ValueError(f"source of {length} tokens exceeds {self.max_source_length}")
        ids = np.full((len(sources), length), self.pad_id, np.int64)
        mask = np.zeros((len(sources), length), np.int64)
        for row, source in enumerate(sources):
            ids[row, : len(source)] = source
            mask[row, : len(source)] = 1
        cross = self.encoder.run(None, {schema.INPUT_IDS: ids, schema.ATTENTION_MASK: mask})
        return EncodedSources(cross, mask)

    def _run(self, cache: KVCache, encoded: EncodedSources, tokens: np.ndarray) -> np.ndarray:
        if self._in_place is not None:
            return self._run_in_place(cache, encoded, tokens)
        R = cache.rows
        new_mask = np.ones((R, 1), np.int64)
        feeds = {
            schema.INPUT_IDS: tokens.reshape(R, 1).astype(np.int64),
            schema.POSITION_IDS: cache.positions.reshape(R, 1),
            schema.ATTENTION_MASK: np.concatenate([cache.mask, new_mask], axis=1),
            schema.ENCODER_ATTENTION_MASK: encoded.mask,
            schema.ENCODER_ROW: cache.encoder_row,
            **cache.feeds(),
        }
        for i in range(self.n_layers):
            key_name, value_name = schema.cross_names(i)
            feeds[key_name], feeds[value_name] = encoded.cross[2 * i], encoded.cross[2 * i + 1]
        logits, *presents = self.decoder.run(None, feeds)
        cache.append(presents, new_mask, cache.positions + 1)
        return logits[:, -1]

    def _run_in_place(self, cache: KVCache, encoded: EncodedSources, tokens: np.ndarray) -> np.ndarray:
        """One token per row (R,) written into the cache buffers by the in-place graph; returns logits (R, V)."""
        inputs = {schema.ENCODER_ATTENTION_MASK: encoded.mask, schema.ENCODER_ROW: cache.encoder_row}
        for i in range(self.n_layers):
            inputs.update(zip(schema.cross_names(i), encoded.cross[2 * i : 2 * i + 2]))
        return self._in_place.run(cache, tokens, inputs)

    def start(self, encoded: EncodedSources) -> tuple[np.ndarray, DecoderBatch]:
        """Feed the decoder start token for every source -> first logits (N, V) and a batch of one row each."""
        cache = KVCache.empty(encoded.count, self.n_layers, self.n_heads, self.head_dim)
        cache.encoder_row = np.arange(encoded.count, dtype=np.int64)
        return self._run(cache, encoded, np.full(encoded.count, self.bos_id, np.int64)), DecoderBatch(cache, encoded)

    def prefill(self, sources: Sequence[Sequence[int]]) -> tuple[np.ndarray, DecoderBatch]:
        """Encoder pass + decoder start token: the prefill of the batching scheduler."""
        return self.start(self.encode(sources))

    def step(self, batch: DecoderBatch, tokens: np.ndarray) -> np.ndarray:
        """Append one token per row (R,) and return the next-token logits (R, V)."""
        if int(batch.cache.positions.max(initial=0)) >= self.max_target_length:
            raise ValueError(f"a row reached the longest target the model embeds ({self.max_target_length})")
        return self._run(batch.cache, batch.encoded, tokens)

    @staticmethod
    def select(batch: DecoderBatch, rows: np.ndarray) -> DecoderBatch:
        """Keep rows `rows`; sources no row attends to any more are dropped and the rows re-pointed."""
        batch.cache.select(rows)
        used = np.unique(batch.cache.encoder_row)
        if len(used) < batch.encoded.count:
            batch.encoded = batch.encoded.select(used)
            batch.cache.encoder_row = np.searchsorted(used, batch.cache.encoder_row).astype(np.int64)
        return batch

    @staticmethod
    def recycle(batch: DecoderBatch, rows: np.ndarray) -> None:
        batch.cache.recycle(rows)

    @staticmethod
    def concatenate(batches: Sequence[DecoderBatch], rows: Sequence[np.ndarray | None] | None = None
                    ) -> DecoderBatch:
        """Stack (selected rows of) several batches; sources no kept row uses go at the next `select`."""
        encoded, offsets = EncodedSources.concatenate([b.encoded for b in batches])
        return DecoderBatch(KVCache.concatenate([b.cache for b in batches], offsets, rows), encoded)

    def default_max_new_tokens(self, source_length: int) -> int:
        """Room for a translation (`TARGET_PER_SOURCE_TOKEN`, `TARGET_SLACK_TOKENS`), within the positional table."""
        room = TARGET_PER_SOURCE_TOKEN * source_length + TARGET_SLACK_TOKENS
        return min(room, self.max_target_length - 1)  # the start token takes position 0

    def translate_ids(self, sources: Sequence[Sequence[int]], make_search: Callable[[int], Search]) -> list[Search]:
        """Decode a batch offline: encode once, start, then steps until every search is done."""
        logits, batch = self.prefill(sources)
        searches = [make_search(i) for i in range(len(sources))]

        def step_fn(tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
            return self.step(self.select(batch, parents), tokens)

        run_search(searches, list(logits), step_fn)
        return searches
