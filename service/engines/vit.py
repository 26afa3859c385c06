"""ViT engine: image preprocessing as the model config says (mode, size, normalisation) and batched inference."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from service.decoding.distributions import softmax, top_k_indices
from service.engines import onnx_schema as schema
from service.engines.runtime import RuntimeOptions, active_provider, create_session
from service.repository import ModelVersion

TRANSPARENT_MODES = ("RGBA", "LA", "PA")
# Rows composited on white at a time: the RGBA copies that compositing needs exist for one strip, not for the
# whole image (a 4000x4000 image: 12 MB of strips instead of 192 MB of copies), and each strip holds the GIL
# for milliseconds, not for the 100 ms a whole large image takes. The result is the same to the byte.
COMPOSITE_STRIP_ROWS = 256
WHITE = (255, 255, 255, 255)  # the opaque RGBA background a transparent image is composited on
MAX_PIXEL_VALUE = 255.0  # 8-bit pixels: divided by this, they lie in [0, 1], where the config's mean and std apply
DEFAULT_TOP_K = 5  # labels per image `classify` returns unless asked for another number


def non_finite_rows(outputs: np.ndarray) -> list[int]:
    """The rows of a model output (B, ...) that hold a NaN or an infinity: a computation that overflowed or a
    broken version, which no response may carry (JSON has no such numbers)."""
    return np.flatnonzero(~np.isfinite(outputs.reshape(len(outputs), -1)).all(axis=1)).tolist()


def has_transparency(image: Image.Image) -> bool:
    return image.mode in TRANSPARENT_MODES or (image.mode == "P" and "transparency" in image.info)


def on_white(image: Image.Image, mode: str) -> Image.Image:
    """`image` alpha-composited on an opaque white background, converted to `mode`, one strip of rows at a time."""
    width, height = image.size
    out = Image.new(mode, image.size)
    for top in range(0, height, COMPOSITE_STRIP_ROWS):
        box = (0, top, width, min(height, top + COMPOSITE_STRIP_ROWS))
        strip = image.crop(box).convert("RGBA")
        white = Image.new("RGBA", strip.size, WHITE)
        out.paste(Image.alpha_composite(white, strip).convert(mode), box)
    return out


class ViTEngine:
    def __init__(self, model: ModelVersion, options: RuntimeOptions = RuntimeOptions()):
        config = model.config
        self.model = model
        self.session = create_session(model.path / config["files"]["model"], options)
        self.provider = active_provider(self.session)
        image = config["image"]
        self.size, self.channels = image["size"], image["channels"]
        self.mean, self.std = float(image["mean"]), float(image["std"])
        self.labels: list[str] = config["labels"]

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """Any Pillow image -> float32 (C, H, W): converted to the model's mode, resized, scaled and standardised.

        Images with transparency are composited on white first, so a transparent background does not turn black.
        """
        mode = "L" if self.channels == 1 else "RGB"
        image = on_white(image, mode) if has_transparency(image) else image.convert(mode)
        if image.size != (self.size, self.size):
            image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / MAX_PIXEL_VALUE
        pixels = pixels[None] if self.channels == 1 else pixels.transpose(2, 0, 1)  # (C, H, W)
        return self.normalize(pixels)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """Pixels scaled to [0, 1], in the model's layout (..., C, H, W) -> the model's standardised input."""
        return ((pixels - self.mean) / self.std).astype(np.float32, copy=False)

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """Preprocessed images (B, C, H, W) -> logits (B, classes)."""
        return self.session.run(None, {schema.PIXEL_VALUES: np.ascontiguousarray(batch, dtype=np.float32)})[0]

    def classify(self, images: Sequence[Image.Image], top_k: int = DEFAULT_TOP_K) -> list[list[tuple[str, int, float]]]:
        """Top-k (label, index, probability) per image."""
        probabilities = softmax(self.logits(np.stack([self.preprocess(image) for image in images])))  # (B, classes)
        top = top_k_indices(probabilities, top_k)
        return [[(self.labels[i], int(i), float(p[i])) for i in row] for p, row in zip(probabilities, top)]
