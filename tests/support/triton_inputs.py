"""Triton clients' input tensors of text (HTTP and gRPC), as the API tests build them: one BYTES tensor of UTF-8
strings."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as triton


def text_input(name: str, texts: list[str], binary: bool = True) -> triton.InferInput:
    """`tritonclient.http`'s: binary tensor data unless `binary` is false (then JSON)."""
    tensor = triton.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
    return tensor


def grpc_text_input(name: str, texts: list[str]) -> tgrpc.InferInput:
    """`tritonclient.grpc`'s (sent as raw_input_contents)."""
    tensor = tgrpc.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor
