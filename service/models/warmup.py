"""Warm-up: one real inference through a freshly loaded engine before the version takes a request, and a check of
what it gave back.

The inference initialises the sessions and makes their first-run allocations, so that the first request does not
pay for them; the checks make a version that would answer every request with an error or a non-finite number
fail here (`WarmUpFailed`, and it is not loaded), so that a version that loads serves. What is checked: the ViT's
config (labels, a finite normalisation with `std > 0`) and outputs (one score per label), a text model's logits
after its prompt pass and after a decoding step (one per token of its vocabulary; that the tokenizer fits the
graphs is checked earlier, when its engine is built: `service.engines.vocabulary`), the translator's default
length penalty, and that every output is finite.
Which input each kind warms up with is `service.models.kinds`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.decoding.beam import MAX_LENGTH_PENALTY


class WarmUpFailed(RuntimeError):
    """A version whose sessions load but whose warm-up inference shows it cannot serve (the reason in the message)."""


def warm_up_text(engine, prompt: Sequence[int]) -> None:
    """A text engine's prompt pass over `prompt` (token ids) and one decoding step (the in-place step graph, where
    there is one); the logits of both checked against the vocabulary the engine was built with (config.json
    `architecture.vocab_size`, which `service.engines.vocabulary` held the tokenizer and the graphs to)."""
    logits, state = engine.prefill([prompt])
    check_logits(logits, engine.vocab_size, "the config's architecture.vocab_size", True, "a short prompt")
    stepped = engine.step(state, logits.argmax(-1))
    check_logits(stepped, engine.vocab_size, "the config's architecture.vocab_size", True, "a decoding step")


def check_length_penalty(engine) -> None:
    """The translator's served default length penalty, held to what a request may ask for."""
    penalty = engine.length_penalty
    if not (np.isfinite(penalty) and abs(penalty) <= MAX_LENGTH_PENALTY):
        raise WarmUpFailed(f"config generation.length_penalty must be a finite number in [-{MAX_LENGTH_PENALTY:g}, "
                           f"{MAX_LENGTH_PENALTY:g}], got {penalty}")


def warm_up_images(engine, level: float) -> None:
    """The ViT's config checked, then one image of one grey `level` (pixels scaled to [0, 1], as a decoded image
    is before normalising) classified, with one score per label."""
    labels = engine.labels
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        raise WarmUpFailed(f"config labels must be a non-empty list of strings, got {labels!r}")
    if not (np.isfinite(engine.mean) and np.isfinite(engine.std) and engine.std > 0):
        raise WarmUpFailed(f"config image normalisation must be finite with std > 0, got mean {engine.mean}, "
                           f"std {engine.std}")
    check_logits(engine.logits(grey_images(engine, 1, level)), len(labels), "the config's labels", True,
                 "a grey image")


def grey_images(engine, count: int, level: float) -> np.ndarray:
    """`count` images of one grey `level` (pixels scaled to [0, 1]) in the ViT's input layout, normalised:
    (count, C, H, W) float32."""
    return engine.normalize(np.full((count, engine.channels, engine.size, engine.size), level, np.float32))


def check_logits(logits: np.ndarray, size: int, what: str, exact: bool, probe: str) -> None:
    """Warm-up outputs (1, V) for `probe`: V equal to `size` (exact) or covering it, every value finite."""
    width = logits.shape[-1] if logits.ndim == 2 and logits.shape[0] == 1 else None
    if width is None or (width != size if exact else width < size):
        raise WarmUpFailed(f"the model outputs shape {list(logits.shape)}, which does not match {what} ({size}"
                           f"{'' if exact else ' or more'} per input)")
    if not np.isfinite(logits).all():
        raise WarmUpFailed(f"the model's outputs for {probe} hold NaN or infinite values")
