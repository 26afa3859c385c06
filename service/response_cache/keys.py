"""Response cache keys (Triton's `src/cache_manager`: a hash of the request): SHA-256 over a canonical serialisation
of everything that decides an answer: the version's scope (model, version, the weights variant and how its graphs
compute, the provider, its config.json), the capability, its inputs and every decoding parameter, the seed among them.

Canonical: JSON with sorted keys and no spaces; a dataclass as the fields that take part in its equality (a compiled
constraint, `compare=False`, is not in it; a field added later is in it by itself), less `NOT_IN_KEY`; tuples as
lists; binary inputs (image bytes, pixels) hashed after the JSON, each behind its length, never encoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from service.response_cache.codec import scalar

# Bumped whenever what a key covers or how a value is encoded changes: entries of another format are never read.
KEY_FORMAT = 1
# Fields of the parameters that decide when a request runs, never what it computes (batch invariance).
NOT_IN_KEY = frozenset({"priority"})
# What of a loaded version's `variant` (`service.models.registry`) decides its numbers: the weights that run, the
# graphs' attention and KV cache, where the cache lives, and n-gram speculation (its verify pass may flip a near-tie).
VARIANT_KEYS = ("weights", "attention", "kv_cache", "kv_residence", "speculation")


def canonical(value: Any) -> Any:
    """`value` as plain JSON data, the same for equal values (see the module docstring)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.compare and f.name not in NOT_IN_KEY}
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return scalar(value)


def _json(value: Any) -> bytes:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def version_scope(name: str, version: int, kind: str, provider: str, variant: Mapping[str, Any],
                  config: Mapping[str, Any]) -> str:
    """What every key of one loaded version starts from: its identity and how it computes. The config is hashed
    whole: a version folder replaced by a new export (which rewrites config.json) gets new keys."""
    return hashlib.sha256(_json({"format": KEY_FORMAT, "model": name, "version": version, "kind": kind,
                                 "provider": provider, "variant": {k: variant.get(k) for k in VARIANT_KEYS},
                                 "config": config})).hexdigest()


def request_key(scope: str, capability: str, fields: Mapping[str, Any], blobs: Sequence[bytes] = ()) -> str:
    """The key of one request to a capability (`translate`, `generate`, `score`, `classify`, `pixels`) of the
    version whose scope is `scope`: its parameters and inputs as `fields`, its binary inputs as `blobs`."""
    digest = hashlib.sha256(scope.encode())
    head = _json({"capability": capability, **fields})
    digest.update(len(head).to_bytes(8, "little") + head)
    for blob in blobs:
        digest.update(len(blob).to_bytes(8, "little"))
        digest.update(blob)
    return digest.hexdigest()
