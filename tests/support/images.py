"""Images as the tests send them: a uint8 pixel array (a Fashion-MNIST image, 28 x 28) encoded as PNG bytes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png_bytes(pixels: np.ndarray) -> bytes:
    """`pixels` (H, W) or (H, W, C) uint8, as the bytes of a PNG file."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
