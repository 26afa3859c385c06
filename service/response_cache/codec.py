"""A cached answer as bytes and back: the serving layer's API-neutral results (`Completion` lists, `Scored`,
probabilities) as JSON, dataclasses tagged with their class name, tuples and numpy arrays tagged too (an array's raw
bytes in base64), so that a hit rebuilds exactly what was computed: every float by its shortest repr (which reads back
to the same double), -inf log-probabilities included, every array bit for bit.

Decoding builds only the classes the caller names (`types`): an entry from a shared Redis is data, never code (no
pickle). An entry that does not decode into them is `Undecodable` (the caller computes the answer afresh).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

TYPE, FIELDS, TUPLE, ARRAY = "~t", "~f", "~u", "~a"  # the tags; no field of a result starts with "~"


class Undecodable(ValueError):
    """An entry that is not an encoding of the expected classes (another format, or corrupted)."""


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {TYPE: type(value).__name__,
                FIELDS: {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}}
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {ARRAY: [data.dtype.str, list(data.shape), base64.b64encode(data.tobytes()).decode("ascii")]}
    if isinstance(value, tuple):
        return {TUPLE: [_plain(v) for v in value]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return scalar(value)


def scalar(value: Any) -> Any:
    """A JSON scalar (numpy's numbers as Python's); TypeError for anything else (what the cache cannot hold)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} cannot be cached")


def encode(value: Any) -> bytes:
    """`value` (dataclasses, lists, tuples, arrays, numbers, strings) as the bytes a cache stores."""
    return json.dumps(_plain(value), separators=(",", ":"), ensure_ascii=False).encode()


def decode(data: bytes, types: Iterable[type]) -> Any:
    """What `encode` encoded, built from the dataclasses `types` only; `Undecodable` otherwise."""
    by_name = {cls.__name__: cls for cls in types}

    def rebuild(obj: dict) -> Any:
        if TYPE in obj:
            cls = by_name.get(obj[TYPE])
            if cls is None:
                raise Undecodable(f"an entry of class {obj[TYPE]!r}, not one of {sorted(by_name)}")
            return cls(**obj[FIELDS])
        if TUPLE in obj:
            return tuple(obj[TUPLE])
        if ARRAY in obj:
            dtype, shape, raw = obj[ARRAY]
            return np.frombuffer(bytearray(base64.b64decode(raw)), dtype=np.dtype(dtype)).reshape(shape)
        return obj

    try:
        return json.loads(data, object_hook=rebuild)
    except (ValueError, TypeError, KeyError) as error:  # JSONDecodeError is a ValueError
        raise Undecodable(str(error)) from None
