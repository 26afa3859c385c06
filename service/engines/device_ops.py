"""Row and slot operations on tensors that stay in the execution provider's memory (ONNX Runtime `OrtValue`s): the
KV cache's reorders, joins and growth (`service.engines.device_cache`) and the encoded sources' (translation),
done on the device by three tiny ONNX graphs run on the same provider as the model, so that no cache byte crosses
to the host. After onnxruntime-genai, which keeps its KV buffers on the device and moves them with its own kernels.

- `gather(tensors, rows)`: each tensor's rows `rows` (axis 0; beam reordering, dropping finished rows);
- `window(tensors, start, end, left, right)`: each tensor's slots [start, end) of axis 2, with `left` / `right`
  zero slots added (growth, trimming, the left padding of a join of exact caches);
- `concat(parts)`: each tensor's rows of every part, in order (joins).
Each graph takes a whole list of tensors (every layer's keys and values) in one run. The same code runs on the CPU
provider with CPU OrtValues, so CI executes every line of it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.engines.onnx_graph.onnx_graph_pb2 import (GraphProto, ModelProto, OperatorSetIdProto, TensorProto,
                                                       TypeProto, ValueInfoProto)
from service.engines.onnx_graph import from_array, make_node
from service.engines.onnx_schema import past_names

OPSET = 17  # Slice and Pad take their bounds as inputs (int64, read on the host by every provider's kernels)
IR_VERSION = 8
SLOT_AXIS = 2  # keys/values and cross-attention tensors: (rows, heads, slots, head_dim)
ELEMENT_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
                 np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int64): TensorProto.INT64}
# ONNX Runtime's type strings of a session's inputs -> numpy element types (what a cache allocates)
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


def past_dtype(session: ort.InferenceSession):
    """The element type of a decoder session's KV cache (its first past input): what a device cache allocates."""
    return ORT_TYPES[next(i.type for i in session.get_inputs() if i.name == past_names(0)[0])]


@dataclass(frozen=True)
class Placement:
    """Where tensors live: ONNX Runtime's device name ("cpu", "cuda") and device id."""

    device: str = "cpu"
    device_id: int = 0

    def upload(self, array: np.ndarray) -> ort.OrtValue:
        """An OrtValue on this device holding a copy of `array` (a one-off: never per decoding step)."""
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)


def _value(name: str, element: int, rank: int) -> ValueInfoProto:
    """A graph input/output of element type `element` and `rank` dimensions, every one dynamic."""
    info = ValueInfoProto(name=name, type=TypeProto())
    tensor = info.type.tensor_type
    tensor.elem_type = element
    for axis in range(rank):
        tensor.shape.dim.add().dim_param = f"{name}_d{axis}"
    return info


def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = GraphProto(name="device_ops", node=nodes, input=inputs, output=outputs, initializer=list(initializers))
    model = ModelProto(ir_version=IR_VERSION, producer_name="service.engines.device_ops", graph=graph,
                       opset_import=[OperatorSetIdProto(domain="", version=OPSET)])
    return model.SerializeToString()


def gather_graph(count: int, element: int) -> bytes:
    """x0..x{count-1} (rank 4), rows (R,) -> y_i = x_i[rows]."""
    nodes = [make_node("Gather", [f"x{i}", "rows"], [f"y{i}"], f"gather{i}", axis=0) for i in range(count)]
    inputs = [_value(f"x{i}", element, 4) for i in range(count)] + [_value("rows", TensorProto.INT64, 1)]
    return _model(nodes, inputs, [_value(f"y{i}", element, 4) for i in range(count)])


def window_graph(count: int, element: int) -> bytes:
    """x_i (rank 4), start (1,), end (1,), pads (8,) -> y_i = Pad(x_i[:, :, start:end], pads): ONNX's pads order,
    every axis's begin then every axis's end."""
    nodes = []
    for i in range(count):
        nodes += [make_node("Slice", [f"x{i}", "start", "end", "axes"], [f"s{i}"], f"slice{i}"),
                  make_node("Pad", [f"s{i}", "pads"], [f"y{i}"], f"pad{i}")]
    inputs = [_value(f"x{i}", element, 4) for i in range(count)] + [
        _value(name, TensorProto.INT64, 1) for name in ("start", "end", "pads")]
    axes = from_array(np.array([SLOT_AXIS], np.int64), "axes")
    return _model(nodes, inputs, [_value(f"y{i}", element, 4) for i in range(count)], [axes])


def concat_graph(count: int, parts: int, element: int) -> bytes:
    """x{i}_{p} for each tensor i of each part p -> y_i = the parts' x_i stacked on axis 0."""
    nodes = [make_node("Concat", [f"x{i}_{p}" for p in range(parts)], [f"y{i}"], f"concat{i}", axis=0)
             for i in range(count)]
    inputs = [_value(f"x{i}_{p}", element, 4) for i in range(count) for p in range(parts)]
    return _model(nodes, inputs, [_value(f"y{i}", element, 4) for i in range(count)])


class DeviceOps:
    """The three operations on one provider (`providers`, as the model's sessions were made) and device
    (`placement`); one small session per graph shape (how many tensors, parts, element type), made when first
    needed. Every call's outputs are fresh OrtValues on the device; its inputs are left as they were."""

    def __init__(self, providers: Sequence, placement: Placement, settings: ort.SessionOptions | None = None):
        self.providers = list(providers)
        self.placement = placement
        self.settings = settings

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one DeviceOps per engine, living as long as it)
    def _session(self, kind: str, count: int, element: int, parts: int = 0) -> ort.InferenceSession:
        graph = {"gather": lambda: gather_graph(count, element), "window": lambda: window_graph(count, element),
                 "concat": lambda: concat_graph(count, parts, element)}[kind]()
        return ort.InferenceSession(graph, sess_options=self.settings, providers=self.providers)

    def _run(self, session: ort.InferenceSession, tensors: dict[str, ort.OrtValue],
             host: dict[str, np.ndarray], count: int) -> list[ort.OrtValue]:
        binding = session.io_binding()
        for name, value in tensors.items():
            binding.bind_ortvalue_input(name, value)
        for name, array in host.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array, np.int64))
        for i in range(count):
            binding.bind_output(f"y{i}", self.placement.device, self.placement.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    @staticmethod
    def _element(tensors: Sequence[ort.OrtValue]) -> int:
        return ELEMENT_TYPES[np.dtype(ORT_TYPES[tensors[0].data_type()])]

    def gather(self, tensors: Sequence[ort.OrtValue], rows: np.ndarray) -> list[ort.OrtValue]:
        """Each tensor's rows `rows` (repeats allowed), in that order."""
        session = self._session("gather", len(tensors), self._element(tensors))
        return self._run(session, {f"x{i}": t for i, t in enumerate(tensors)}, {"rows": rows}, len(tensors))

    def window(self, tensors: Sequence[ort.OrtValue], start: int, end: int, left: int = 0, right: int = 0
               ) -> list[ort.OrtValue]:
        """Each tensor's slots [start, end) (axis 2), with `left` zero slots before and `right` after."""
        pads = np.zeros(8, np.int64)
        pads[SLOT_AXIS], pads[4 + SLOT_AXIS] = left, right
        session = self._session("window", len(tensors), self._element(tensors))
        return self._run(session, {f"x{i}": t for i, t in enumerate(tensors)},
                         {"start": np.array([start]), "end": np.array([end]), "pads": pads}, len(tensors))

    def concat(self, parts: Sequence[Sequence[ort.OrtValue]]) -> list[ort.OrtValue]:
        """Each tensor's rows of every part, stacked in the parts' order (one part: returned as it is)."""
        if len(parts) == 1:
            return list(parts[0])
        count = len(parts[0])
        session = self._session("concat", count, self._element(parts[0]), len(parts))
        return self._run(session, {f"x{i}_{p}": part[i] for p, part in enumerate(parts) for i in range(count)},
                         {}, count)
