"""Image classification with the ViT, for every API: encoded images -> decoding and preprocessing within the
request's deadline and the server's memory budget (`service.engines.imaging`) -> the model's dynamic batcher ->
probabilities per image. Each API applies its own top-k or output selection. Logits holding a NaN or an
infinity are an explicit error (`ModelOutputError`), never scores that no JSON can carry."""

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
from service.serving.context import Caller

log = logging.getLogger(__name__)


async def classify(request: Caller, loaded: LoadedModel, images: Sequence[EncodedImage],
                   deadline: float) -> np.ndarray:
    """Softmax probabilities (n, classes) float32, one row per encoded image, in order."""
    decoder = request.app.state.image_decoder
    pixels = await watched(request, decoder.decode(images, loaded.engine, deadline), deadline)  # (n, C, H, W)
    return await classify_pixels(request, loaded, pixels, deadline)


async def classify_pixels(request: Caller, loaded: LoadedModel, pixels: np.ndarray,
                          deadline: float) -> np.ndarray:
    """Softmax probabilities (n, classes) of images already preprocessed to the model's input (n, C, H, W)."""
    job = loaded.scheduler.submit(ImageJob(pixels=pixels, deadline=deadline))
    with tracing.image_spans(loaded, job):  # its queue wait and inference, once over (tracing on)
        logits = (await await_results(request, [job.future], deadline,
                                      abandon=lambda: loaded.scheduler.cancel(job)))[0]  # (n, classes)
    if bad := non_finite_rows(logits):
        log.error("%s/%s computed non-finite logits for images %s of a request", loaded.name, loaded.version, bad)
        raise ModelOutputError(f"model {loaded.name} version {loaded.version} computed non-finite scores (NaN or "
                               f"infinity) for images {bad} (0-based, in request order)")
    return softmax(logits).astype(np.float32, copy=False)
