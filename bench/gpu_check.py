"""`make gpu-check`: the CUDA path proved on one NVIDIA machine, in one run of at most 10 minutes, with one report.

Runnable by hand on any NVIDIA machine with Python 3.12 (the wheels' tag) and the CUDA 13 libraries (the
`nvidia-*-cu13` wheels, or a CUDA image), with no package index: everything it installs comes from a local wheel
folder that `make gpu-wheels` prepares on a machine with one (bench/gpu/wheels.py says what it holds). Steps, each
under its own timeout (bench/gpu/steps.py):

1. wheels: puts the onnxruntime-gpu wheel back together from its `split -b 18M` parts and checks every wheel's
   sha256 against the locks (requirements/serving-gpu.txt; the tools' in requirements/dev.txt), refusing a gap in
   the parts or a hash the lock does not list (naming both);
2. install: a venv (--system-site-packages: the image's torch and numpy) with those wheels, `pip install --no-index
   --no-deps`; every later step runs in it (without a wheel folder, in this interpreter);
3. environment: nvidia-smi's GPU name, driver and memory (absent: recorded as absent), ONNX Runtime's version and
   providers, and whether a session asked for CUDA really runs on CUDA (bench/gpu/probe.py);
4. gpu-tests: `pytest -m gpu tests/gpu` (CUDA in use in each model's sessions, outputs equal to CPU's);
5. bench-engine-cpu, bench-engine-cuda: bench/bench_engine.py's own engine on each device, GPT tokens/s at 64
   streams and translation beam-4 sentences/s at batch 32;
6. bench-http: bench/bench_http.py against the service on CUDA (TSERVE_DEVICE=cuda, the committed model
   repository in float32), 32 streams for 60 s; any error fails it.

Then reports/gpu_check.json and reports/gpu_check.txt: each step's status (passed / failed / skipped: why), the
GPU and driver, the CPU model, CUDA/CPU ratios. Without a GPU (a dry run) the steps that need CUDA are skipped by
name with the reason and the others run; the exit status is 1 when a step failed, else 0.

    make gpu-wheels                        # on a machine with PyPI: fills .cache/gpu-wheels (GPU_WHEELS)
    make gpu-check                         # on the GPU machine (or here: a dry run)
    .venv/bin/python bench/gpu_check.py --steps wheels,environment,gpu-tests --http-seconds 20
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT / "bench"))

from gpu import report, wheels  # after the sys.path set-up
from gpu.steps import STEPS, TIMEOUTS_S, TOTAL_BUDGET_S, Context, run_steps

DEFAULT_WHEELS = PROJECT_ROOT / ".cache" / "gpu-wheels"
DEFAULT_VENV = PROJECT_ROOT / ".cache" / "venv-gpu"
DEFAULT_OUT = PROJECT_ROOT / "reports"


def parse_timeouts(text: str) -> dict[str, float]:
    """`gpu-tests=200,bench-http=240` -> the default timeouts with those replaced."""
    timeouts = dict(TIMEOUTS_S)
    for item in filter(None, text.split(",")):
        name, _, seconds = item.partition("=")
        if name not in timeouts:
            raise ValueError(f"unknown step {name!r}; steps: {', '.join(timeouts)}")
        timeouts[name] = float(seconds)
    return timeouts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, default=Path(os.environ.get("GPU_WHEELS") or DEFAULT_WHEELS),
                        help="the offline wheel folder (default $GPU_WHEELS, else .cache/gpu-wheels)")
    parser.add_argument("--prepare-wheels", action="store_true",
                        help="fill --wheels from PyPI (make gpu-wheels) and exit; needs an index")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the venv `install` makes (.cache/venv-gpu)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the report's folder (default reports/: gpu_check.json, gpu_check.txt, gpu_check/)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--timeouts", default="", help="per step, seconds: gpu-tests=200,bench-http=240")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds for all the steps together (default {TOTAL_BUDGET_S})")
    parser.add_argument("--http-seconds", type=float, default=None, help="bench-http's load (default 60 s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="ONNX Runtime intra-op threads of the benchmarks (default: every core)")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        files = wheels.prepare(args.wheels)
        for path in files:
            print(f"{path.stat().st_size / 2**20:8.1f} MiB  {path.name}")
        print(f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB in {args.wheels}")
        return 0
    names = [name for name in args.steps.split(",") if name]
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
    try:
        timeouts = parse_timeouts(args.timeouts)
    except ValueError as error:
        parser.error(str(error))
    context = Context(wheels=args.wheels.resolve(), venv=args.venv.resolve(), out=(args.out / "gpu_check").resolve(),
                      threads=args.threads)
    if args.http_seconds is not None:
        context.http_seconds = args.http_seconds
    steps = run_steps(context, names, timeouts, args.budget)
    command = shlex.join([Path(sys.executable).name, "bench/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    built = report.build({step.name: step for step in steps}, context.probe, command)
    as_json, as_text = report.write(built, args.out)
    print("\n" + report.render(built) + f"wrote {as_json} and {as_text}", flush=True)
    return 0 if built["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
