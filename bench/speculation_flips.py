"""N-gram speculation (`TSERVE_SPECULATION=ngram`) on the released GPT, through the running batch (`TextBatch`) on the
engine directly: how often its outputs differ from plain greedy decoding, and what it gains.

    .venv/bin/python bench/speculation_flips.py [--prompts 1000] [--new-tokens 32] [--variants fp32,int8,...]

1. Flips: `--prompts` prompts of the tinyshakespeare validation text (`bench.httpbench.cases.gpt_prompts`), each
   continued greedily for `--new-tokens` tokens with speculation off (batches of 64) and on (batches of its
   `--rows`, as served), per weights variant; prints the prompts whose output differs, where the first difference
   falls, and how many tokens came out of verify passes.
2. Speed (`--timed` variants): tokens/s on / off at one stream on a copy-heavy prompt (its continuation repeats the
   prompt's lines) and on open continuations, then at 2, 4 and 8 streams of open continuations with
   speculation allowed at that many rows, and at 32 with the default limit (it switches off); runs taking turns, medians over `--rounds`.
The verify pass differs from plain steps in the last bits (`service.engines.speculation`): a difference is a
near-tie flipped, which is why speculation is off by default (docs/speculation.md).
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
from bench.httpbench.cases import gpt_prompts  # noqa: E402
from service.decoding import GreedySearch  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS, RuntimeOptions  # noqa: E402
from service.repository import ModelRepository  # noqa: E402
from service.scheduling.jobs import TextJob  # noqa: E402
from service.scheduling.speculation import MAX_ROWS, SpeculationConfig  # noqa: E402
from service.scheduling.text_batch import TextBatch  # noqa: E402

PROMPT_CHARS = 64  # bytes, so tokens
PLAIN_ROWS = 64  # plain decoding's batches (batch-invariant: the same tokens as alone)
# a prompt whose greedy continuation repeats its own lines (the release GPT falls into this loop by itself)
COPY_PROMPT = "LUCIO:\nI will be so.\n\n" * 4 + "LUCIO:\nI will"
TIMED_TOKENS = 128  # new tokens of a timed run
OPEN_PROMPTS = 8  # open continuations timed at one stream, one after the other
STREAMS = (2, 4, 8)  # speculation allowed at these many rows, to choose TSERVE_SPECULATION_MAX_ROWS
SERVED_STREAMS = 32  # and at this many, as served (switched off above its default)
DEADLINE_S = 3600.0


def decode(engine: GPTEngine, prompts: list[list[int]], new_tokens: int, rows: int,
           speculation: SpeculationConfig | None) -> tuple[list[list[int]], float, int, int]:
    """Greedy continuations of `prompts`, `rows` at a time -> (tokens of each, seconds, draft tokens, accepted)."""
    outputs, drafted, accepted = [], 0, 0
    started = time.perf_counter()
    for first in range(0, len(prompts), rows):
        jobs = [TextJob(ids, GreedySearch(new_tokens, engine.eos_id), "greedy", time.monotonic() + DEADLINE_S)
                for ids in prompts[first : first + rows]]
        batch, generations = TextBatch.prefill(engine, jobs)
        batch.speculation = speculation
        while True:
            failed = [g.error for g in generations if g.error is not None]
            if failed:
                raise failed[0]
            batch.filter([g.job for g in generations if not g.done])
            if not batch.jobs:
                break
            generations = batch.generate_token()
            drafted += sum(g.drafted for g in generations)
            accepted += sum(g.accepted for g in generations)
        outputs += [job.search.results()[0].tokens for job in jobs]
    return outputs, time.perf_counter() - started, drafted, accepted


def flips(engine: GPTEngine, prompts: list[list[int]], new_tokens: int, rows: int) -> str:
    plain, plain_s, _, _ = decode(engine, prompts, new_tokens, PLAIN_ROWS, None)
    spec, spec_s, drafted, accepted = decode(engine, prompts, new_tokens, rows, SpeculationConfig(max_rows=rows))
    firsts = [next(i for i, (a, b) in enumerate(zip(p + [-1], s + [-2])) if a != b)
              for p, s in zip(plain, spec) if p != s]
    tokens = sum(map(len, plain))
    where = f", first difference at token {sorted(firsts)}" if firsts else ""
    return (f"{len(firsts)} of {len(prompts)} prompts differ ({sum(len(p) - i for p, i in zip(plain, firsts))} of "
            f"{tokens} tokens after a first difference{where}); {accepted} tokens accepted of {drafted} drafted "
            f"({plain_s:.0f} s off at {PLAIN_ROWS} rows, {spec_s:.0f} s on at {rows})")


def ratio(engine: GPTEngine, prompts: list[list[int]], rows: int, rounds: int, max_rows: int | None = None) -> str:
    """tokens/s on / off for `prompts` continued `rows` at a time, taking turns, medians over `rounds`; on:
    speculating at up to `max_rows` rows (default: `rows`)."""
    config = SpeculationConfig(max_rows=max_rows or rows)
    decode(engine, prompts, TIMED_TOKENS, rows, config)  # untimed: sessions warm at these shapes
    times = {"off": [], "on": []}
    for _ in range(rounds):
        for name, speculation in (("off", None), ("on", config)):
            out, seconds, drafted, accepted = decode(engine, prompts, TIMED_TOKENS, rows, speculation)
            times[name].append(seconds)
    tokens = sum(map(len, out))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return (f"off {tokens / off:7.0f} tok/s, on {tokens / on:7.0f} tok/s, on/off {off / on:.2f} "
            f"(accepted {accepted} of {drafted} drafted)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=MAX_ROWS, help="the speculative batches' rows (flips)")
    parser.add_argument("--variants", default="fp32,int8,fp32+gqa,int8+gqa")
    parser.add_argument("--timed", default="fp32,int8", help="the variants timed (none: '')")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=None, help="the data folder (models.data's default)")
    args = parser.parse_args()
    print(describe(), flush=True)
    model = ModelRepository(ROOT / "model_repository").get("gpt")
    # as the service runs it (2 decoding workers: a one-thread session beside the wide one)
    options = RuntimeOptions(single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS["gpt"], one_thread_when_concurrent=True)
    texts = gpt_prompts(args.data, args.prompts, PROMPT_CHARS)
    timed = [v for v in args.timed.split(",") if v]
    for variant in dict.fromkeys([*args.variants.split(","), *timed]):
        engine = GPTEngine(model, replace(options, weights=variant))
        prompts = [engine.tokenizer.encode(text).ids for text in texts]
        if variant in args.variants.split(","):
            print(f"gpt:{model.version} {variant}, {args.new_tokens} new tokens: "
                  f"{flips(engine, prompts, args.new_tokens, args.rows)}", flush=True)
        if variant not in timed:
            continue
        copy = [engine.tokenizer.encode(COPY_PROMPT).ids]
        print(f"  1 stream, copy-heavy prompt: {ratio(engine, copy, 1, args.rounds)}", flush=True)
        print(f"  1 stream, {OPEN_PROMPTS} open continuations: "
              f"{ratio(engine, prompts[:OPEN_PROMPTS], 1, args.rounds)}", flush=True)
        for streams in STREAMS:  # speculating at that many rows
            print(f"  {streams:2d} streams, open continuations: "
                  f"{ratio(engine, prompts[:streams], streams, args.rounds)}", flush=True)
        print(f"  {SERVED_STREAMS} streams, open continuations, default TSERVE_SPECULATION_MAX_ROWS ({MAX_ROWS}): "
              f"{ratio(engine, prompts[:SERVED_STREAMS], SERVED_STREAMS, args.rounds, MAX_ROWS)}", flush=True)


if __name__ == "__main__":
    main()
