"""The Open Inference Protocol's raw layout of a BYTES tensor (REST's binary tensor data extension, gRPC's
`raw_input_contents` / `raw_output_contents`): each element as its 4-byte little-endian length, then its bytes.
Standard library only: the load generator's image copies this file (deploy/Dockerfile.locust)."""

from __future__ import annotations

import struct
from collections.abc import Iterable

BYTES_LENGTH = "<I"  # a BYTES element's length prefix: 4 bytes, little-endian unsigned
BYTES_LENGTH_SIZE = struct.calcsize(BYTES_LENGTH)


def pack_bytes(items: Iterable[bytes]) -> bytes:
    """BYTES elements in the raw layout."""
    return b"".join(struct.pack(BYTES_LENGTH, len(item)) + item for item in items)


def unpack_bytes(raw: bytes) -> list[bytes]:
    """The elements of well-formed raw BYTES data (what a server sends; a request's data is checked element by
    element as it is read: `service.api.oip.protocol`)."""
    items, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from(BYTES_LENGTH, raw, offset)
        start = offset + BYTES_LENGTH_SIZE
        items.append(raw[start : start + length])
        offset = start + length
    return items
