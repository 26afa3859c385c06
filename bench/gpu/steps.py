"""The steps of `make gpu-check`, in order (`STEPS`): each runs in a subprocess (or in-process, for the wheel
folder) under its own timeout and ends `passed`, `failed` or `skipped` with a one-line reason. A step that needs
CUDA is skipped, naming why, where the probe found none in use: on a CPU machine the check is a dry run of the rest.

The default timeouts add up to `TOTAL_BUDGET_S` less a margin for the report, so the whole check fits 10 minutes
on an H100 however the steps go; each is also cut to what is left of the budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import venv
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from . import PROJECT_ROOT, wheels

TOTAL_BUDGET_S = 600  # the bound: the whole check within 10 minutes on an H100
# per step (seconds); the sum is 570, leaving 30 s of the budget for the probe's and the report's own work.
# install: a venv and ~45 wheels offline, onnxruntime-gpu's 255 MB unpacked (~20 s); gpu-tests: three models loaded
# on CUDA and on CPU in two variants; bench-engine-*: its export of the random-weight models (the first of the two,
# ~20 s) and 1 warm-up + 3 timed passes per case; bench-http: the server's start (CUDA init, model loads; no
# calibration: TSERVE_VARIANT pinned), warm-up, HTTP_SECONDS of load, and the benchmark's roofline (~10 s)
TIMEOUTS_S = {"wheels": 20, "install": 90, "environment": 20, "gpu-tests": 120, "bench-engine-cpu": 75,
              "bench-engine-cuda": 75, "bench-http": 170}
HTTP_SECONDS = 60  # the issue's: `make bench-http` against the service on CUDA for 60 s
HTTP_STREAMS = 32
# the variant the service runs on CUDA: float32 (the release graphs store int8 MatMulNBits, meant for CPUs), pinned
# so that the server starts without timing variants (TSERVE_VARIANT=auto's calibration)
HTTP_VARIANT = "fp32"
ENGINE_GPT_BATCH = 64  # GPT tokens/s at 64 streams
ENGINE_TRANSLATION_BATCH = 32  # translation beam-4 sentences/s at batch 32
ENGINE_REPEATS, ENGINE_WARMUP = 3, 1
OUTPUT_TAIL_LINES = 15
KILL_GRACE_S = 5
# the modules the check's steps import: an offline venv missing one fails at install, naming it
IMPORTS = ("onnxruntime", "numpy", "fastapi", "uvicorn", "tokenizers", "pydantic_settings", "grpc", "PIL",
           "prometheus_client", "multipart", "opentelemetry.sdk", "pytest", "httpx")
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
PYTEST_NO_TESTS = 5  # pytest's exit status when nothing was collected
JUNIT_MODULE_SKIP = "collection skipped"  # pytest's junit message for a module skipped whole


@dataclass
class Step:
    name: str
    status: str = SKIPPED
    reason: str = ""
    seconds: float = 0.0
    timeout_s: float | None = None
    details: dict = field(default_factory=dict)


@dataclass
class Context:
    """What the steps share: the options, the interpreter the steps after `install` run, the probe's findings."""
    wheels: Path
    venv: Path
    out: Path  # reports/gpu_check/: each step's log and the benchmarks' JSON
    python: str = sys.executable
    threads: int = os.cpu_count() or 1
    http_seconds: float = HTTP_SECONDS
    probe: dict = field(default_factory=dict)
    steps: dict[str, Step] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return bool(self.probe.get("cuda_in_use"))

    def no_cuda(self) -> str:
        return f"needs CUDA in use: {self.probe.get('cuda_why_not') or 'the environment step did not run'}"


def run(context: Context, name: str, command: list[str], timeout_s: float, env: dict | None = None
        ) -> tuple[int | None, str]:
    """Run `command` in the project root, its own process group, output to `<out>/logs/<name>.log` -> (exit
    status, or None when it ran out of time and was killed, group and all; the output's last lines)."""
    log = context.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write("$ " + " ".join(command) + "\n")
        f.flush()
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = None
    tail = log.read_text(errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
    return code, "\n".join(tail)


def ran(step: Step, code: int | None, tail: str) -> bool:
    """Mark `step` failed when its command did not exit 0; True when it did."""
    if code == 0:
        return True
    step.status = FAILED
    step.reason = (f"timed out after {step.timeout_s:.0f} s" if code is None else f"exit status {code}") + \
        f"; last lines: {tail.splitlines()[-1] if tail else '(no output)'}"
    step.details["output_tail"] = tail
    return False


def wheels_step(context: Context, step: Step) -> None:
    parts = list(context.wheels.glob(f"*.whl{wheels.PART_MARK}*")) if context.wheels.is_dir() else []
    if not parts and not (context.wheels.is_dir() and any(context.wheels.glob("*.whl"))):
        step.reason = f"no wheel folder at {context.wheels} (`make gpu-wheels` prepares one)"
        return
    try:
        step.details = wheels.check_folder(context.wheels)
    except wheels.WheelError as error:
        step.status, step.reason = FAILED, str(error)
        return
    step.status = PASSED
    step.reason = f"{len(step.details['wheels'])} wheels, each sha256 as locked"


def install_step(context: Context, step: Step) -> None:
    if context.steps["wheels"].status != PASSED:
        step.reason = f"the wheel folder is not ready (wheels: {context.steps['wheels'].status})"
        return
    # the ABI tags that pin an interpreter (cp312), not abi3 nor none
    tags = {name.split("-")[3] for name in context.steps["wheels"].details["wheels"]} - {"abi3", "none"}
    mine = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if tags and tags != {mine}:
        step.reason = f"the wheels are for {', '.join(sorted(tags))}; this is Python {sys.version.split()[0]}"
        return
    venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(context.venv)
    python = str(context.venv / "bin" / "python")
    files = [str(path) for path in sorted(context.wheels.glob("*.whl"))]
    code, tail = run(context, step.name, [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                                          *files], step.timeout_s)
    if not ran(step, code, tail):
        return
    missing = [module for module in IMPORTS
               if subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode != 0]
    if missing:
        step.status, step.reason = FAILED, f"installed, but {python} cannot import {', '.join(missing)}"
        return
    context.python = python
    step.status, step.reason = PASSED, f"{len(files)} wheels into {context.venv} (offline, system site packages)"


def environment_step(context: Context, step: Step) -> None:
    code, tail = run(context, step.name, [context.python, str(PROJECT_ROOT / "bench" / "gpu" / "probe.py")],
                     step.timeout_s)
    if not ran(step, code, tail):
        return
    context.probe = json.loads(tail.splitlines()[-1])
    sys.path.insert(0, str(PROJECT_ROOT / "bench"))
    from cpuinfo import cpu

    context.probe["cpu"] = cpu()
    step.details = context.probe
    step.status = PASSED
    step.reason = "CUDA in use" if context.cuda else f"no CUDA: {context.probe['cuda_why_not']}"


def gpu_tests_step(context: Context, step: Step) -> None:
    junit = context.out / "gpu_tests.xml"
    code, tail = run(context, step.name, [context.python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs",
                                          "-p", "no:cacheprovider", f"--junitxml={junit}"], step.timeout_s)
    counts = junit_counts(junit) if junit.is_file() else {}
    step.details = counts
    if code == 0 and counts.get("passed"):
        step.status, step.reason = PASSED, f"{counts['passed']} GPU tests passed, {counts['skipped']} skipped"
    elif code == 0 and counts.get("skip_reasons"):
        step.reason = f"every GPU test skipped: {counts['skip_reasons'][0]}"
    elif code == PYTEST_NO_TESTS:
        step.status, step.reason = FAILED, "pytest collected no GPU test (-m gpu tests/gpu)"
    else:
        ran(step, code, tail)


def junit_counts(path: Path) -> dict:
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    reasons = list(dict.fromkeys(skip_reason(s) for s in suite.iter("skipped")))
    return {"tests": total, "passed": total - skipped - failed, "failed": failed, "skipped": skipped,
            "skip_reasons": reasons}


def skip_reason(skipped) -> str:
    """A junit <skipped>'s reason: its message, or for a module skipped whole (message "collection skipped") its
    text less the `path:line: ` before it."""
    message = skipped.get("message", "")
    if message != JUNIT_MODULE_SKIP:
        return message
    return (skipped.text or "").strip().split(": ", 1)[-1]


def bench_engine_step(device: str):
    def step_fn(context: Context, step: Step) -> None:
        if device == "cuda" and not context.cuda:
            step.reason = context.no_cuda()
            return
        out = context.out / f"bench_engine_{device}.json"
        command = [context.python, "bench/bench_engine.py", "--device", device, "--tasks", "gpt,translation",
                   "--systems", "ours", "--gpt-batches", str(ENGINE_GPT_BATCH), "--translation-batches",
                   str(ENGINE_TRANSLATION_BATCH), "--repeats", str(ENGINE_REPEATS), "--warmup", str(ENGINE_WARMUP),
                   "--threads", str(context.threads), "--shipped-variant", "stored", "--out", str(out)]
        code, tail = run(context, step.name, command, step.timeout_s)
        if not ran(step, code, tail):
            return
        results = json.loads(out.read_text())["results"]
        cases = {r["case"]: {"unit": r["unit"], "throughput": r["systems"]["ours"]["throughput"]}
                 for r in results if "ours" in r["systems"]}
        step.details = {"cases": cases, "report": str(out)}
        step.status = PASSED
        step.reason = "; ".join(f"{case}: {v['throughput']:.1f} {v['unit']}" for case, v in cases.items())

    return step_fn


def bench_http_step(context: Context, step: Step) -> None:
    if not context.cuda:
        step.reason = context.no_cuda()
        return
    out, workdir = context.out / "bench_http_cuda.json", PROJECT_ROOT / ".cache" / "gpu_check" / "bench_http"
    command = [context.python, "bench/bench_http.py", "--device", "cuda", "--repository", "model_repository",
               "--data-dir", "tests/fixtures/data", "--cases", "gpt", "--gpt-concurrency", str(HTTP_STREAMS),
               "--duration", str(context.http_seconds), "--rounds", "1", "--threads", str(context.threads),
               "--server-env", f"TSERVE_VARIANT={HTTP_VARIANT}", "--out", str(out), "--workdir", str(workdir)]
    code, tail = run(context, step.name, command, step.timeout_s)
    if not ran(step, code, tail):
        return
    cases = json.loads(out.read_text())["cases"]
    case = next((c for c in cases if c["case"] == f"gpt c={HTTP_STREAMS}"), None)
    log = workdir / "logs" / "service.log"
    fallbacks = [line for line in log.read_text(errors="replace").splitlines()
                 if "did not start" in line] if log.is_file() else []
    step.details = {"case": case, "server_log": str(log), "cuda_fallbacks": fallbacks[:3]}
    if case is None or case["ok"] == 0:
        step.status, step.reason = FAILED, f"no successful request in the gpt c={HTTP_STREAMS} case"
    elif case["errors"] or fallbacks:
        step.status = FAILED
        step.reason = (f"{case['errors']} errors ({case['error_kinds']})" if case["errors"]
                       else f"a session fell back from CUDA: {fallbacks[0]}")
    else:
        step.status = PASSED
        step.reason = (f"{case['throughput']:.0f} {case['unit']} at {HTTP_STREAMS} streams, {case['ok']} requests, "
                       "0 errors")


STEPS = {"wheels": wheels_step, "install": install_step, "environment": environment_step,
         "gpu-tests": gpu_tests_step, "bench-engine-cpu": bench_engine_step("cpu"),
         "bench-engine-cuda": bench_engine_step("cuda"), "bench-http": bench_http_step}


def run_steps(context: Context, names: list[str], timeouts: dict[str, float], budget_s: float) -> list[Step]:
    """Run the steps `names` (in `STEPS`' order), each under min(its timeout, what is left of `budget_s`); a step
    not among `names` is recorded as skipped by request."""
    start = time.monotonic()
    for name, step_fn in STEPS.items():
        step = context.steps[name] = Step(name)
        left = budget_s - (time.monotonic() - start)
        if name not in names:
            step.reason = "not asked for (--steps)"
            continue
        if left <= 0:
            step.reason = f"the {budget_s:.0f} s budget is spent"
            continue
        step.timeout_s = min(timeouts[name], left)
        began = time.monotonic()
        print(f"[gpu-check] {name} (timeout {step.timeout_s:.0f} s) ...", flush=True)
        step_fn(context, step)
        step.seconds = round(time.monotonic() - began, 1)
        print(f"[gpu-check] {name}: {step.status}{': ' + step.reason if step.reason else ''} "
              f"({step.seconds:.1f} s)", flush=True)
    return list(context.steps.values())
