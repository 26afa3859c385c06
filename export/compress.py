"""Smaller model files: store large float32 weights as float16 and cast them back to float32 when loading.

Each large initializer W becomes W_fp16 plus a `Cast(to=float)` node producing W; ONNX Runtime folds the cast at
session start, so inference still runs in float32 on weights rounded to float16 (about 3 significant digits).
Files halve; the quality delta is measured by the caller and recorded in the model card.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def store_weights_as_fp16(path: Path, min_elements: int = 1024) -> tuple[int, int]:
    """Rewrite the ONNX file at `path` in place; returns (bytes before, bytes after)."""
    before = path.stat().st_size
    model = onnx.load(str(path))
    graph = model.graph
    casts = []
    for initializer in list(graph.initializer):
        if initializer.data_type != TensorProto.FLOAT or int(np.prod(initializer.dims)) < min_elements:
            continue
        weights = numpy_helper.to_array(initializer)
        graph.initializer.remove(initializer)
        half_name = f"{initializer.name}__fp16"
        graph.initializer.append(numpy_helper.from_array(weights.astype(np.float16), half_name))
        casts.append(helper.make_node("Cast", [half_name], [initializer.name], to=TensorProto.FLOAT,
                                      name=f"{initializer.name}__to_fp32"))
    for node in reversed(casts):
        graph.node.insert(0, node)
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return before, path.stat().st_size
