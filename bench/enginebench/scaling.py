"""The scaling table: our GPT engine (plain and shipped graph) at each batch on the release GPT's shape, next to its
fp32 matmul roofline (the step's matmuls in torch, same threads) measured in the same run, interleaved per batch."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import numpy as np

from .measure import measure
from .ours import run_ours_gpt, run_shipped_gpt
from .workloads import GenerateFn, GptSpec, make_prompts, release_gpt_spec

def run_roofline_gpt(spec: GptSpec, batch: int) -> GenerateFn:
    """The fp32 matmul roofline of one GPT decoding step at `batch`, as a GenerateFn for `measure`: per pass,
    `spec.new_tokens` steps, each step every matmul of the model at one token per row, as the model's own
    nn.Linear layers run them (`torch.nn.functional.linear`, weight (out, in), bias added): per layer the q, k, v
    and attention-output projections (d -> d), MLP up (d -> d_ff) and down (d_ff -> d), then the tied LM head
    (d -> vocab, no bias). torch's threads are the harness's (set in `main`). Returns a placeholder of the right
    shape (it produces no tokens). F.linear is the fastest of the torch forms here: measured against
    addmm/matmul on (in, out) weights, 15% faster at batch 8-64 and equal at batch 1 and 128."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    d, ff = spec.d_model, spec.d_ff
    x = torch.randn(batch, d, generator=generator)
    hidden = torch.randn(batch, ff, generator=generator)

    def linear(inputs, n_out: int, bias: bool = True):
        weight = torch.randn(n_out, inputs.shape[1], generator=generator) * 0.02
        return inputs, weight, (torch.randn(n_out, generator=generator) * 0.02 if bias else None)

    ops = []
    for _ in range(spec.n_layers):
        ops += [linear(x, d), linear(x, d), linear(x, d), linear(x, d), linear(x, ff), linear(hidden, d)]
    ops.append(linear(x, spec.vocab_size, bias=False))
    placeholder = np.zeros((batch, spec.new_tokens), np.int64)

    def generate(prompts: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            for _ in range(spec.new_tokens):
                for inputs, weight, bias in ops:
                    F.linear(inputs, weight, bias)
        return placeholder

    return generate


def bench_scaling(args) -> dict:
    """Our GPT engine at each batch in --scaling-batches vs the fp32 matmul roofline, interleaved per batch."""
    spec = release_gpt_spec()
    print(f"Scaling (our GPT engine vs its fp32 matmul roofline): {spec}", flush=True)
    ours = run_ours_gpt(spec, args.runtime, args.workdir)
    shipped = run_shipped_gpt(spec, args.runtime, args.workdir)
    rows = []
    for batch in args.scaling_batches:
        prompts = make_prompts(spec, batch)
        systems = {"ours": ours, "shipped": shipped, "roofline": run_roofline_gpt(spec, batch)}
        times, _ = measure(systems, [prompts], spec.new_tokens, args.warmup, args.repeats)
        tokens = batch * spec.new_tokens
        ours_tp = tokens / statistics.median(times["ours"])
        shipped_tp = tokens / statistics.median(times["shipped"])
        roofline_tp = tokens / statistics.median(times["roofline"])
        rows.append({"batch": batch, "ours_tokens_per_s": ours_tp, "shipped_tokens_per_s": shipped_tp,
                     "roofline_tokens_per_s": roofline_tp, "fraction_of_roofline": ours_tp / roofline_tp,
                     "shipped_fraction_of_roofline": shipped_tp / roofline_tp,
                     "roofline_step_ms": statistics.median(times["roofline"]) / spec.new_tokens * 1000,
                     "ours_seconds": [round(t, 4) for t in times["ours"]],
                     "shipped_seconds": [round(t, 4) for t in times["shipped"]],
                     "roofline_seconds": [round(t, 4) for t in times["roofline"]]})
        print(f"  batch {batch:>3}: ours {ours_tp:>9.1f} tok/s   shipped {shipped_tp:>9.1f} tok/s   roofline "
              f"{roofline_tp:>9.1f} tok/s   fractions {ours_tp / roofline_tp:.2f} {shipped_tp / roofline_tp:.2f}",
              flush=True)
    return {"case": f"gpt scaling, release shape, greedy {spec.prompt_tokens}+{spec.new_tokens} tokens",
            "spec": asdict(spec), "rows": rows}


def print_scaling(scaling: dict) -> None:
    header = (f"{'batch':>5} {'ours tok/s':>12} {'shipped tok/s':>14} {'roofline tok/s':>15} {'fraction':>9} "
              f"{'shipped fraction':>17} {'roofline ms/step':>17}")
    print(f"\n{scaling['case']} (median of {len(scaling['rows'][0]['ours_seconds']) if scaling['rows'] else 0} "
          "passes; roofline = the step's matmuls in torch, same threads)")
    print("=" * len(header))
    print(header)
    print("-" * len(header))
    for row in scaling["rows"]:
        print(f"{row['batch']:>5} {row['ours_tokens_per_s']:>12.1f} {row['shipped_tokens_per_s']:>14.1f} "
              f"{row['roofline_tokens_per_s']:>15.1f} {row['fraction_of_roofline']:>9.2f} "
              f"{row['shipped_fraction_of_roofline']:>17.2f} {row['roofline_step_ms']:>17.3f}")
    print("=" * len(header))
