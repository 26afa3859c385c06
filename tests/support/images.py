"""Images as the tests send them: a uint8 pixel array (a Fashion-MNIST image, 28 x 28) encoded as PNG bytes."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def png_bytes(pixels: np.ndarray) -> bytes:
    """`pixels` (H, W) or (H, W, C) uint8, as the bytes of a PNG file."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_claiming(width: int, height: int) -> bytes:
    """A valid PNG of one pixel whose header (IHDR, CRC fixed) claims width x height: a decompression bomb's shape."""
    data = bytearray(png_bytes(np.zeros((1, 1), dtype=np.uint8)))
    ihdr = data[12:29]  # chunk type + 13 bytes of header data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)
