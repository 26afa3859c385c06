"""Image classification with the ViT, for every API: encoded images -> decoding and preprocessing within the
request's deadline and the server's memory budget (`service.engines.imaging`) -> the model's dynamic batcher ->
probabilities per image. Each API applies its own top-k or output selection. Logits holding a NaN or an
infinity are an explicit error (`ModelOutputError`), never scores that no JSON can carry. A repeat is answered from
the response cache where it is on (`service.serving.cached`: keyed by the images' bytes, or the pixels')."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from service.decoding import softmax
from service.engines.imaging import EncodedImage
from service.engines.vit import non_finite_rows
from service.errors import ModelOutputError
from service.models.registry import LoadedModel
from service.observability import tracing
from service.scheduling.jobs import ImageJob
from service.serving.awaiting import await_results, watched
from service.serving.cached import CLASSIFY, PIXELS, answer
from service.serving.context import Caller, priority_level

log = logging.getLogger(__name__)


async def classify(request: Caller, loaded: LoadedModel, images: Sequence[EncodedImage],
                   deadline: float, priority: int | None = None) -> np.ndarray:
    """Softmax probabilities (n, classes) float32, one row per encoded image, in order; queued at `priority`
    (`service.scheduling.priority`; None: the model's default)."""
    level = priority_level(loaded, priority)

    async def compute() -> np.ndarray:
        decoder = request.app.state.image_decoder
        pixels = await watched(request, decoder.decode(images, loaded.engine, deadline), deadline)  # (n, C, H, W)
        return await _probabilities(request, loaded, pixels, deadline, level)

    texts = [isinstance(image.data, str) for image in images]  # base64 text, else file bytes
    blobs = [image.data.encode() if text else image.data for image, text in zip(images, texts)]
    return await answer(loaded, CLASSIFY, {"base64": texts}, compute, blobs=blobs)


async def classify_pixels(request: Caller, loaded: LoadedModel, pixels: np.ndarray,
                          deadline: float, priority: int | None = None) -> np.ndarray:
    """Softmax probabilities (n, classes) of images already preprocessed to the model's input (n, C, H, W)."""
    level = priority_level(loaded, priority)
    fields = {"dtype": pixels.dtype.str, "shape": pixels.shape}
    return await answer(loaded, PIXELS, fields, lambda: _probabilities(request, loaded, pixels, deadline, level),
                        blobs=[np.ascontiguousarray(pixels).tobytes()])


async def _probabilities(request: Caller, loaded: LoadedModel, pixels: np.ndarray, deadline: float,
                         level: int) -> np.ndarray:
    job = loaded.scheduler.submit(ImageJob(pixels=pixels, deadline=deadline, priority=level))
    with tracing.image_spans(loaded, job):  # its queue wait and inference, once over (tracing on)
        logits = (await await_results(request, [job.future], deadline,
                                      abandon=lambda: loaded.scheduler.cancel(job)))[0]  # (n, classes)
    if bad := non_finite_rows(logits):
        log.error("%s/%s computed non-finite logits for images %s of a request", loaded.name, loaded.version, bad)
        raise ModelOutputError(f"model {loaded.name} version {loaded.version} computed non-finite scores (NaN or "
                               f"infinity) for images {bad} (0-based, in request order)")
    return softmax(logits).astype(np.float32, copy=False)
