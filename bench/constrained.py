"""What a constraint costs the released GPT (issue 54's goals), offline through `GPTEngine.generate`, as ratios
beside the CPU they ran on:

- decoding cost per generated token, constrained (a JSON schema of 10 properties, every row's mask filled each step)
  / unconstrained, greedy and seeded sampling, at batch 1 and 8: every row generates exactly `--tokens` tokens
  (the schema's documents are longer, and `min_new_tokens` keeps the free rows from ending early), so both sides
  decode the same number of tokens;
- the first token of a request with a new schema (compiled then: `ConstraintCompiler.compile` on a miss) and of one
  with the same schema again (the compiled cache), minus an unconstrained first token, in ms.

Rounds are interleaved (every case once per round, after an untimed warm-up round); figures are medians.

    .venv/bin/python bench/constrained.py [--rounds 7] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpuinfo import describe  # noqa: E402
from service.decoding.constraints import Constraint  # noqa: E402
from service.decoding.sampling import SamplingSearch  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(b"ROMEO:\n")
BATCHES = (1, 8)
MODES = {"greedy": 0.0, "sampled": 1.0}


def schema(tag: str = "") -> dict:
    """A 10-property object; `tag` renames one property, so that each tag is a new schema to compile."""
    string = {"type": "string", "maxLength": 12}
    properties = {
        "name": string, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email", "maxLength": 24}, "city": string,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
        "tags": {"type": "array", "items": {"enum": ["king", "fool", "nurse", "friar"]}, "maxItems": 3},
        "role": {"enum": ["lead", "chorus", "servant"]}, f"joined{tag}": {"type": "string", "format": "date"},
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def decode(engine: GPTEngine, rows: int, tokens: int, temperature: float, constraint: Constraint | None
           ) -> tuple[float, int]:
    """One batch of `rows` identical requests -> (seconds, tokens generated), compile included when not cached."""
    started = time.perf_counter()
    compiled = None if constraint is None else engine.constraints.compile(constraint)
    searches = engine.generate([PROMPT] * rows, lambda i: SamplingSearch(
        tokens, engine.eos_id, temperature=temperature, seed=i, min_new_tokens=tokens if compiled is None else 0,
        constraint=None if compiled is None else compiled.row()))
    seconds = time.perf_counter() - started
    return seconds, sum(len(s.results()[0].tokens) for s in searches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=96, help="tokens every row generates")
    args = parser.parse_args(argv)
    print(describe())
    engine = GPTEngine(ModelRepository(ROOT / "model_repository").get("gpt"))
    same = Constraint.of("json_schema", schema(), "json_schema")
    per_token: dict[tuple, list[float]] = {}
    first: dict[str, list[float]] = {"unconstrained": [], "new schema": [], "cached schema": []}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, untimed
        for rows in BATCHES:
            for mode, temperature in MODES.items():
                for constrained in (False, True):
                    seconds, generated = decode(engine, rows, args.tokens, temperature, same if constrained else None)
                    if generated != rows * args.tokens:
                        raise SystemExit(f"{generated} tokens generated, not {rows} x {args.tokens}: raise the "
                                         "schema's lengths or lower --tokens")
                    if round_:
                        per_token.setdefault((rows, mode, constrained), []).append(seconds / generated)
        new = Constraint.of("json_schema", schema(f"_{round_}"), "json_schema")  # never compiled before
        for name, constraint in (("unconstrained", None), ("new schema", new), ("cached schema", same)):
            seconds, _ = decode(engine, 1, 1, 0.0, constraint)
            if round_:
                first[name].append(seconds)
    median = {key: statistics.median(values) for key, values in per_token.items()}
    print(f"\nper generated token, medians of {args.rounds} interleaved rounds, {args.tokens} tokens a row:")
    print("| batch | rows | unconstrained ms/token | constrained ms/token | constrained / unconstrained |")
    print("| --- | --- | --- | --- | --- |")
    for rows in BATCHES:
        for mode in MODES:
            free, bound = median[(rows, mode, False)], median[(rows, mode, True)]
            print(f"| {rows} | {mode} | {free * 1e3:.3f} | {bound * 1e3:.3f} | {bound / free:.2f} |")
    base = statistics.median(first["unconstrained"])
    print(f"\nfirst token (prefill + one step, batch 1, greedy), medians of {args.rounds}:")
    print("| request | first token ms | over unconstrained ms |")
    print("| --- | --- | --- |")
    for name, values in first.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {(statistics.median(values) - base) * 1e3:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
