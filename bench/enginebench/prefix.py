"""The prefix-cache task (`--tasks prefix`, issue 55): our GPT engine's prompt pass with and without its prefix
cache, no HTTP. The release GPT's shape (random weights) as `shipped` runs it (the release graph's rewrite, the
weights variant the host is served), `GPTEngine.prefill_cached` of one prompt at a time, a shared prefix of
`PREFIX_TOKENS` tokens and `SUFFIX_TOKENS` of its own (random regular ids):

- hit: an engine with a cache of `CACHE_BYTES` (RuntimeOptions.prefix_cache_bytes), the shared prefix (its warm-up
  pass kept it) and a new suffix each pass: 192 of 216 tokens from the cache (whole blocks of 16);
- miss: the same engine, a prefix never seen each pass (and so kept, and once the budget is full evicting);
- off: an engine without a cache, the hit's prompts.

Each timed repeat runs `PASSES` prompts through each, interleaved round-robin like the other tasks; the median ms
per prompt pass, the ratios hit/miss (issue 55's TTFT goal over HTTP: <= 0.3), hit/off and miss/off, the cached
tokens per hit, and whether the hit's next-token logits equal the cache-off engine's bit for bit (they must).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import numpy as np

from .workloads import FIRST_REGULAR_ID, GptSpec, release_gpt_spec

PREFIX_TOKENS = 200
SUFFIX_TOKENS = 16
PASSES = 16  # prompt passes per system and timed repeat
CACHE_BYTES = 256 << 20  # TSERVE_PREFIX_CACHE_MB's default
SYSTEMS = ("hit", "miss", "off")


def prefix_prompts(spec: GptSpec, count: int, seed: int, shared: list[int] | None = None) -> list[list[int]]:
    """`count` prompts of `PREFIX_TOKENS + SUFFIX_TOKENS` regular ids drawn with `seed`: each after `shared` when
    given (only the suffix drawn), else all its own."""
    rng = np.random.default_rng(seed)
    own = SUFFIX_TOKENS if shared is not None else PREFIX_TOKENS + SUFFIX_TOKENS
    rows = rng.integers(FIRST_REGULAR_ID, spec.vocab_size, size=(count, own)).tolist()
    return [(shared or []) + row for row in rows]


def bench_prefix(args) -> dict:
    """The task's result: ms per prompt pass of each system (median over the repeats), the ratios and the checks."""
    from shipped import shipped_variant

    from .ours import _runs_as, ours_gpt_engine

    spec = release_gpt_spec()
    print(f"Prefix cache (our GPT engine's prompt pass, {PREFIX_TOKENS}-token shared prefix + {SUFFIX_TOKENS}, "
          f"batch 1): {spec}", flush=True)
    variant, runs_as = shipped_variant("gpt"), _runs_as(args.runtime, "gpt")
    cached = ours_gpt_engine(spec, args.runtime, args.workdir, variant, runs_as, prefix_cache_bytes=CACHE_BYTES)
    plain = ours_gpt_engine(spec, args.runtime, args.workdir, variant, runs_as)
    result = {"case": f"gpt prefix cache, prompt pass of {PREFIX_TOKENS}+{SUFFIX_TOKENS} tokens, batch 1",
              "unit": "ms per prompt pass", "spec": asdict(spec), "runs_as": runs_as or "as stored",
              "prefix_caching": dict(cached.prefix_caching), "systems": {}}
    if cached.prefix_cache is None:
        result["skipped"] = f"the engine keeps no prefix cache: {cached.prefix_caching.get('reason')}"
        print(f"  skipped: {result['skipped']}", flush=True)
        return result
    shared = prefix_prompts(spec, 1, seed=0)[0][:PREFIX_TOKENS]

    def prompts(system: str, turn: int) -> list[list[int]]:  # new ones every turn: a miss is never seen before
        if system == "miss":
            return prefix_prompts(spec, PASSES, seed=2 * turn + 1)
        return prefix_prompts(spec, PASSES, seed=2 * turn + 2, shared=shared)  # seed 0: the shared prefix's

    engines = {"hit": cached, "miss": cached, "off": plain}
    cached.prefill_cached([shared + [FIRST_REGULAR_ID] * SUFFIX_TOKENS])  # keeps the shared prefix
    hits, identical = [], True
    for repeat in range(-args.warmup, args.repeats):  # negative: untimed warm-ups
        for system in SYSTEMS:
            batch = prompts(system, repeat + args.warmup)
            started = time.perf_counter()
            passes = [engines[system].prefill_cached([prompt]) for prompt in batch]
            seconds = time.perf_counter() - started
            if repeat >= 0:
                result["systems"].setdefault(system, []).append(seconds / len(batch) * 1000)
            if system == "hit":
                hits += [p.cached_tokens[0] for p in passes]
                reference = [plain.prefill_cached([prompt]).logits for prompt in batch[:2]]
                identical &= all(np.array_equal(p.logits, r) for p, r in zip(passes, reference))
    medians = {system: statistics.median(ms) for system, ms in result["systems"].items()}
    result.update({"median_ms": medians, "cached_tokens_per_hit": statistics.mean(hits),
                   "hit_logits_identical_to_off": identical,
                   "ratios": {"hit/miss": medians["hit"] / medians["miss"], "hit/off": medians["hit"] / medians["off"],
                              "miss/off": medians["miss"] / medians["off"]}})
    print_prefix(result)
    return result


def print_prefix(result: dict) -> None:
    if "median_ms" not in result:
        return
    repeats = len(result["systems"]["hit"])
    print(f"\n  {result['case']} ({result['unit']}, median of {repeats} repeats of {PASSES} passes; "
          f"runs as {result['runs_as']})")
    for system in SYSTEMS:
        ms = result["systems"][system]
        print(f"    {system:<6} {result['median_ms'][system]:>8.2f} ms   (range {min(ms):.2f}-{max(ms):.2f})")
    print("    " + "   ".join(f"prefix {key} = {value:.2f}" for key, value in result["ratios"].items()))
    print(f"    cached tokens per hit: {result['cached_tokens_per_hit']:.0f} of {PREFIX_TOKENS + SUFFIX_TOKENS}; "
          f"hit logits identical to the cache-off engine's: {result['hit_logits_identical_to_off']}", flush=True)
