"""The Open Inference Protocol's tensor signature of each model kind: its inputs and outputs as (name, datatype,
shape), what the model metadata reports and what an inference request's inputs are checked against. One table
keyed by kind (the kinds of `service.repository`, whose other traits are `service.models.kinds`'), as
Triton's model configuration lists a model's `input` and `output`; -1 is a dimension of any size, as the protocol
writes it.

`model_config` is Triton's model configuration extension (`GET /v2/models/{m}[/versions/{v}]/config`, what
`tritonclient.http.InferenceServerClient.get_model_config` returns): the fields of Triton's `ModelConfig` that say
something true of a served version, in Triton's JSON names. `max_batch_size` is 0, as Triton writes a model whose
shapes hold their batch dimension themselves: the dims are the signature's, -1 first where a request may send any
number of items, and the server batches on its own (continuous batching for text, dynamic batching for images),
not as Triton's scheduler would (which, with a `max_batch_size` above 0, would prepend a batch dimension the dims
leave out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.models.registry import LoadedModel
from service.repository import GPT, TRANSLATION, VIT

ANY = -1  # a dimension of any size (the batch, a text's shape)
TensorSpec = tuple[str, str, list[int]]  # name, datatype, shape
# Triton's names for the model's runtime (ONNX Runtime) in the model metadata and configuration
PLATFORM, BACKEND = "onnxruntime_onnx", "onnxruntime"
# Triton's `data_type` for a protocol datatype: TYPE_<datatype>, except that BYTES is TYPE_STRING
TRITON_STRING = "TYPE_STRING"
# Triton's instance kinds; a version runs on the GPU when its ONNX Runtime provider is CUDA's
KIND_CPU, KIND_GPU, GPU_PROVIDER = "KIND_CPU", "KIND_GPU", "CUDAExecutionProvider"
# Triton's max_batch_size of a model whose dims hold the batch dimension themselves (see above)
DIMS_HOLD_THE_BATCH = 0


@dataclass(frozen=True)
class Signature:
    """A model's input and output tensors."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def input_datatypes(self) -> dict[str, str]:
        return {name: datatype for name, datatype, _ in self.inputs}

    def output_names(self) -> list[str]:
        return [name for name, _, _ in self.outputs]


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


def triton_data_type(datatype: str) -> str:
    """A protocol datatype as Triton's model configuration names it: FP32 -> TYPE_FP32, BYTES -> TYPE_STRING."""
    return TRITON_STRING if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(loaded: LoadedModel, versions: list[int]) -> dict:
    """Triton's model configuration of a loaded version; `versions` are the model's loaded versions."""
    tensors = signature(loaded)
    return {
        "name": loaded.name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": {"specific": {"versions": versions}},
        "max_batch_size": DIMS_HOLD_THE_BATCH,
        "input": [{"name": name, "data_type": triton_data_type(datatype), "format": "FORMAT_NONE", "dims": shape}
                  for name, datatype, shape in tensors.inputs],
        "output": [{"name": name, "data_type": triton_data_type(datatype), "dims": shape, "label_filename": ""}
                   for name, datatype, shape in tensors.outputs],
        "instance_group": [{"name": f"{loaded.name}_0", "count": 1,
                            "kind": KIND_GPU if loaded.provider == GPU_PROVIDER else KIND_CPU}],
        "parameters": {"kind": {"string_value": loaded.kind}},
        # Triton's `response_cache { enable: true }` (service.response_cache)
        "response_cache": {"enable": bool(loaded.response_cache and loaded.response_cache.enabled)},
    }
