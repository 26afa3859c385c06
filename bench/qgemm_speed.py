"""ONNX Runtime's integer GEMM against its float32 GEMM on this CPU, one op each: `MatMulInteger` (u8 x s8, the
QGEMM the `int8rows` variants run, service/engines/integer_gemm.py) and `MatMul` (float32), same shapes, constant
weights, M rows of activations, medians of back-to-back runs. Tells which MLAS kernel a CPU reaches: AVX-512 VNNI
gives the integer GEMM ~4x float32's multiply-adds per cycle, AMX-INT8 tiles far more (docs/benchmarks.md, "Issue 56
on an Intel Xeon with AMX").

    .venv/bin/python bench/qgemm_speed.py [--k 1024] [--n 4096] [--rows 1,4,16,64,256,1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpuinfo import describe  # noqa: E402

OPSET = 17
SEVEN_BITS = 64  # weights in [-63, 63], as int8rows stores them
RUNS_PER_ROW = 20000  # runs of an M-row call: this / M (at least MIN_RUNS), so each size takes a similar time
MIN_RUNS = 20


def session(node: helper.NodeProto, input_type: int, output_type: int, k: int, n: int, initializers: list,
            threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("a", input_type, [None, k])],
                              [helper.make_tensor_value_info("y", output_type, [None, n])], initializers)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_us(run, feed: np.ndarray, rows: int) -> float:
    for _ in range(5):
        run(None, {"a": feed})
    times = []
    for _ in range(max(MIN_RUNS, RUNS_PER_ROW // rows)):
        started = time.perf_counter()
        run(None, {"a": feed})
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    k, n = args.k, args.n
    weights8 = rng.integers(-SEVEN_BITS + 1, SEVEN_BITS, (k, n)).astype(np.int8)
    weights32 = rng.standard_normal((k, n)).astype(np.float32)
    integer = session(helper.make_node("MatMulInteger", ["a", "w", "zero"], ["y"]), TensorProto.UINT8,
                      TensorProto.INT32, k, n, [numpy_helper.from_array(weights8, "w"),
                                                numpy_helper.from_array(np.array(128, np.uint8), "zero")], args.threads)
    floats = session(helper.make_node("MatMul", ["a", "w"], ["y"]), TensorProto.FLOAT, TensorProto.FLOAT, k, n,
                     [numpy_helper.from_array(weights32, "w")], args.threads)
    print(describe())
    print(f"K={k} N={n}, {args.threads} thread(s): median us per call, GMAC/s")
    for rows in (int(r) for r in args.rows.split(",")):
        int_us = median_us(integer.run, rng.integers(0, 256, (rows, k)).astype(np.uint8), rows)
        float_us = median_us(floats.run, rng.standard_normal((rows, k)).astype(np.float32), rows)
        macs = rows * k * n / 1e3  # per microsecond -> GMAC/s
        print(f"M={rows:5d}  u8s8 {int_us:9.1f} us ({macs / int_us:6.1f} GMAC/s)  float32 {float_us:9.1f} us "
              f"({macs / float_us:6.1f} GMAC/s)  float32/u8s8 {float_us / int_us:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
