"""Where a GPT weights variant's time per generated token goes over a request's length: why the start-up
calibration (`service.models.calibration`) times the GPT over `GPT_CALIBRATION_STEPS` tokens, not 16.

    .venv/bin/python bench/calibration_length.py [--variants int8,int8+gqa] [--rows 1,64] [--steps 128] [--rounds 3]

For each variant of the served (highest) GPT and each batch size: the prompt pass over copies of the calibration
prompt, the first step (where the cache grows into its buffers), the median step of steps 2-16 and of the rest,
and the time per generated token over the first 16 steps (the old calibration's workload) and over all `--steps`.
The variants take turns each round (after one untimed round), medians over the rounds; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpuinfo import describe  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS, RuntimeOptions  # noqa: E402
from service.models.kinds import GPT_CALIBRATION_PROMPT  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

SHORT_STEPS = 16  # the calibration's length before it took a served request's


def time_request(engine: GPTEngine, prompt: list[int], rows: int, steps: int) -> dict[str, float]:
    """Seconds of one request of `rows` copies of `prompt` continued by `steps` greedy tokens, by phase."""
    started = time.perf_counter()
    logits, state = engine.prefill([prompt] * rows)
    prefill = time.perf_counter() - started
    step_seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = engine.step(state, logits.argmax(-1))
        step_seconds.append(time.perf_counter() - started)
    short = prefill + sum(step_seconds[:SHORT_STEPS])
    return {"prefill_ms": 1e3 * prefill, "first_step_ms": 1e3 * step_seconds[0],
            f"steps_2_{SHORT_STEPS}_ms": 1e3 * statistics.median(step_seconds[1:SHORT_STEPS]),
            f"steps_{SHORT_STEPS + 1}_{steps}_ms": 1e3 * statistics.median(step_seconds[SHORT_STEPS:]),
            f"per_token_{SHORT_STEPS}_ms": 1e3 * short / (rows * (SHORT_STEPS + 1)),
            f"per_token_{steps}_ms": 1e3 * (prefill + sum(step_seconds)) / (rows * (steps + 1))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--variants", default="int8,int8+gqa")
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.steps <= SHORT_STEPS:
        parser.error(f"--steps must be more than {SHORT_STEPS}")
    model = ModelRepository(args.repository).get("gpt")
    options = RuntimeOptions(single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS["gpt"])
    engines = {v: GPTEngine(model, replace(options, weights=v)) for v in args.variants.split(",")}
    prompt = next(iter(engines.values())).tokenizer.encode(GPT_CALIBRATION_PROMPT).ids
    print(describe())
    print(f"gpt/{model.version}, prompt of {len(prompt)} tokens, {args.steps} steps, {args.rounds} rounds")
    for rows in map(int, args.rows.split(",")):
        samples: dict[str, list[dict[str, float]]] = {v: [] for v in engines}
        for round_ in range(args.rounds + 1):
            for variant, engine in engines.items():
                timing = time_request(engine, prompt, rows, args.steps)
                if round_:  # the first round is untimed: first-run allocations
                    samples[variant].append(timing)
        for variant, timings in samples.items():
            medians = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
            print(f"{variant:>9} rows {rows:>3}: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
