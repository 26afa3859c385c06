"""The translator's decoding state: the encoded sources a batch attends to and the batch itself (its rows' KV cache).

`EncodedSources` holds each decoder layer's cross-attention keys/values once per source; every decoding row (a beam,
or a request's single greedy row) points at its source through the cache's `encoder_row`, so beams share their
source by index. They are numpy arrays on the host, or, when the decoder's KV cache lives on the device
(`service.engines.device_cache`), OrtValues moved by `service.engines.device_ops` (`ops`): nothing of them crosses
to the host after the encoder pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.engines.device_cache import DeviceKVCache
from service.engines.device_ops import DeviceOps
from service.engines.kv_cache import KVCache


@dataclass
class EncodedSources:
    """Cross-attention K/V of a set of sources: flat [layer 0 key, layer 0 value, ...], each (N, H, S, Dh), and
    the source mask (N, S); with `ops`, the K/V are OrtValues on its device."""

    cross: list[np.ndarray] | list[ort.OrtValue]
    mask: np.ndarray
    ops: DeviceOps | None = None

    @property
    def count(self) -> int:
        return self.mask.shape[0]

    @staticmethod
    def concatenate(parts: Sequence[EncodedSources]) -> tuple[EncodedSources, list[int]]:
        """Stack sources (right-padding the source axis); returns the result and each part's first row."""
        length = max(p.mask.shape[1] for p in parts)
        offsets = [int(o) for o in np.cumsum([0] + [p.count for p in parts[:-1]])]
        mask = np.concatenate([np.pad(p.mask, [(0, 0), (0, length - p.mask.shape[1])]) for p in parts])
        ops = parts[0].ops
        if ops is not None:
            padded = [p.cross if p.mask.shape[1] == length else
                      ops.window(p.cross, 0, p.mask.shape[1], 0, length - p.mask.shape[1]) for p in parts]
            return EncodedSources(ops.concat(padded), mask, ops), offsets

        def right_pad(array: np.ndarray) -> np.ndarray:
            widths = [(0, 0)] * array.ndim
            widths[2] = (0, length - array.shape[2])
            return np.pad(array, widths) if widths[2][1] else array

        cross = [np.concatenate([right_pad(p.cross[i]) for p in parts]) for i in range(len(parts[0].cross))]
        return EncodedSources(cross, mask), offsets

    def select(self, sources: np.ndarray) -> EncodedSources:
        if self.ops is not None:
            return EncodedSources(self.ops.gather(self.cross, sources), self.mask[sources], self.ops)
        return EncodedSources([c[sources] for c in self.cross], self.mask[sources])


@dataclass
class DecoderBatch:
    """The decoding state of a batch: the self-attention cache of every row and the sources the rows attend to."""

    cache: KVCache | DeviceKVCache
    encoded: EncodedSources

    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def positions(self) -> np.ndarray:
        return self.cache.positions
