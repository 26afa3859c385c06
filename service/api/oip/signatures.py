"""The Open Inference Protocol's tensor signature of each model kind: its inputs and outputs as (name, datatype,
shape), what the model metadata reports and what an inference request's inputs are checked against. One table
keyed by kind (the kinds of `service.models.repository`, whose other traits are `service.models.kinds`'), as
Triton's model configuration lists a model's `input` and `output`; -1 is a dimension of any size, as the protocol
writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.models.registry import LoadedModel
from service.models.repository import GPT, TRANSLATION, VIT

ANY = -1  # a dimension of any size (the batch, a text's shape)
TensorSpec = tuple[str, str, list[int]]  # name, datatype, shape


@dataclass(frozen=True)
class Signature:
    """A model's input and output tensors."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def input_datatypes(self) -> dict[str, str]:
        return {name: datatype for name, datatype, _ in self.inputs}


def _vit(engine) -> Signature:
    """Encoded image files, or pixels [N, H, W] (one channel) / [N, C, H, W]; probabilities and the top label."""
    size, channels = engine.size, engine.channels
    pixels = [ANY, size, size] if channels == 1 else [ANY, channels, size, size]
    return Signature([("IMAGE", "BYTES", [ANY]), ("PIXELS", "FP32", pixels)],
                     [("PROBABILITIES", "FP32", [ANY, len(engine.labels)]), ("LABEL", "BYTES", [ANY])])


def _translation(engine) -> Signature:
    """German texts of any shape; their translations and scores in the same shape."""
    return Signature([("TEXT", "BYTES", [ANY])], [("TRANSLATION", "BYTES", [ANY]), ("SCORE", "FP32", [ANY])])


def _gpt(engine) -> Signature:
    """Prompts of any shape; their continuations and finish reasons in the same shape."""
    return Signature([("PROMPT", "BYTES", [ANY])], [("TEXT", "BYTES", [ANY]), ("FINISH_REASON", "BYTES", [ANY])])


SIGNATURES: dict[str, Callable[[object], Signature]] = {VIT: _vit, TRANSLATION: _translation, GPT: _gpt}


def signature(loaded: LoadedModel) -> Signature:
    """The tensors of a loaded model (shapes from its engine: the image size, the number of labels)."""
    return SIGNATURES[loaded.kind](loaded.engine)
