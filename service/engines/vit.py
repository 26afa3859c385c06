"""ViT engine: image preprocessing as the model config says (mode, size, normalisation) and batched inference."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from service import onnx_schema as schema
from service.repository import ModelVersion
from service.runtime import RuntimeOptions, active_provider, create_session


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
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba)
        image = image.convert("L" if self.channels == 1 else "RGB")
        if image.size != (self.size, self.size):
            image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        pixels = pixels[None] if self.channels == 1 else pixels.transpose(2, 0, 1)  # (C, H, W)
        return (pixels - self.mean) / self.std

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """Preprocessed images (B, C, H, W) -> logits (B, classes)."""
        return self.session.run(None, {schema.PIXEL_VALUES: np.ascontiguousarray(batch, dtype=np.float32)})[0]

    def classify(self, images: Sequence[Image.Image], top_k: int = 5) -> list[list[tuple[str, int, float]]]:
        """Top-k (label, index, probability) per image."""
        logits = self.logits(np.stack([self.preprocess(image) for image in images]))
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities = shifted / shifted.sum(axis=1, keepdims=True)
        top = np.argsort(-probabilities, axis=1, kind="stable")[:, :top_k]
        return [[(self.labels[i], int(i), float(p[i])) for i in row] for p, row in zip(probabilities, top)]
