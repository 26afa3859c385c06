"""What the load-time projection fusion (`service.engines.projection_fusion`) buys: our engines on the released
models with their sibling projections fused (the service's default) and as exported, interleaved round by round in
one process, so that both see the same host. Outputs must be equal (checked every round, else it stops).

    .venv/bin/python bench/fusion_ablation.py [--repository model_repository] [--rounds 7]
        [--gpt-variant int8+gqa] [--translation-variant fp32] [--gpt-batches 1,16,64]
        [--translation-batches 1,16,32] [--new-tokens 128] [--data-dir ../shared/data]

Prints the CPU model and ISA, then one line per case, `fused/unfused <model> b<batch> = <ratio>` of the median
throughputs (GPT: greedy, `--new-tokens` tokens per row; translation: beam 4 on the first test_2016_flickr
sentences, or the committed fixture's). Two intra-op threads, idle threads sleeping, as the service runs.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cpuinfo import describe as describe_cpu  # noqa: E402
from service.decoding import BeamSearch, GreedySearch  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS, RuntimeOptions  # noqa: E402
from service.engines.translation import TranslationEngine  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

THREADS = 2
BEAMS = 4
GPT_PROMPT = "ROMEO:\nBut soft, what light"
TEST_SOURCES = "multi30k/test_2016_flickr.de.gz"
FIXTURE_DATA = ROOT / "tests" / "fixtures" / "data"


def _sources(data_dir: Path, count: int) -> list[str]:
    path = data_dir / TEST_SOURCES if (data_dir / TEST_SOURCES).is_file() else FIXTURE_DATA / TEST_SOURCES
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [line.strip() for _, line in zip(range(count), lines)]


def _engines(engine_class, version, kind: str, variant: str | None) -> dict[bool, object]:
    return {fuse: engine_class(version, RuntimeOptions(device="cpu", intra_op_threads=THREADS, weights=variant,
                                                       single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS[kind],
                                                       fuse_projections=fuse))
            for fuse in (True, False)}


def _interleaved(decoders: dict[bool, object], units: int, rounds: int) -> dict[bool, float]:
    """Median units/s of each decoder over `rounds` alternating rounds (the order flips each round); their
    outputs must be equal."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds + 1):  # the first round warms up, untimed
        outputs = {}
        for fuse in ((True, False) if round_ % 2 else (False, True)):
            start = time.perf_counter()
            outputs[fuse] = decoders[fuse]()
            if round_:
                times[fuse].append(time.perf_counter() - start)
        if outputs[True] != outputs[False]:
            raise SystemExit("fused and unfused outputs differ: the fusion must not change a result")
    return {fuse: units / statistics.median(t) for fuse, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gpt-variant", default="int8+gqa", help="the GPT's variant (service.engines.weights)")
    parser.add_argument("--translation-variant", default="fp32")
    parser.add_argument("--gpt-batches", default="1,16,64")
    parser.add_argument("--translation-batches", default="1,16,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = parser.parse_args(argv)
    print(describe_cpu(), flush=True)
    repository = ModelRepository(args.repository)

    gpt = _engines(GPTEngine, repository.get("gpt"), "gpt", args.gpt_variant)
    for batch in (int(b) for b in args.gpt_batches.split(",") if b):
        prompts = [gpt[True].tokenizer.encode(GPT_PROMPT).ids] * batch

        def decode(engine=None, prompts=prompts):
            searches = engine.generate(prompts, lambda _: GreedySearch(args.new_tokens, engine.eos_id,
                                                                       min_new_tokens=args.new_tokens))
            return [r.tokens for s in searches for r in s.results()]

        rate = _interleaved({f: (lambda e=e: decode(e)) for f, e in gpt.items()}, batch * args.new_tokens,
                            args.rounds)
        print(f"fused/unfused gpt {args.gpt_variant} b{batch} = {rate[True] / rate[False]:.3f}   "
              f"({rate[True]:,.0f} vs {rate[False]:,.0f} tokens/s)", flush=True)

    translation = _engines(TranslationEngine, repository.get("translation"), "translation", args.translation_variant)
    batches = [int(b) for b in args.translation_batches.split(",") if b]
    sentences = _sources(args.data_dir, max(batches + [10]))
    for batch in batches:
        sources = [[translation[True].source_ids(s)] for s in sentences[:10]] if batch == 1 else \
            [[translation[True].source_ids(s) for s in sentences[:batch]]]

        def translate(engine=None, sources=sources):
            out = []
            for group in sources:  # batch 1: ten sentences one at a time
                searches = engine.translate_ids(group, lambda _: BeamSearch(BEAMS, 2 * 40, engine.eos_id))
                out += [s.results()[0].tokens for s in searches]
            return out

        rate = _interleaved({f: (lambda e=e: translate(e)) for f, e in translation.items()},
                            sum(len(g) for g in sources), args.rounds)
        print(f"fused/unfused translation {args.translation_variant} beam{BEAMS} b{batch} = "
              f"{rate[True] / rate[False]:.3f}   ({rate[True]:.1f} vs {rate[False]:.1f} sentences/s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
