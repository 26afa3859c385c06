"""The parts of bench/bench_engine.py (which documents the benchmark, holds its options and runs it):

- workloads.py: the model sizes, the inputs, the special ids and the thread settings every system shares;
- baselines.py: transformers, Optimum and ONNX Runtime GenAI (on our exported GPT graph) as systems;
- ours.py: our engine as a system, on our models exported once per spec (plain, and the shipped graph variant);
- systems.py: the systems by task and name, and building those asked for (or skipping them, with the reason);
- measure.py: warm-up and interleaved timed repeats, the output checks, a case's summary;
- scaling.py: the scaling table, our GPT engine per batch against its fp32 matmul roofline;
- report.py: the printed results and table, and the environment recorded in the JSON report.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
