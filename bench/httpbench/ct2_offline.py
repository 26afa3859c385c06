"""The translator's C++ peer, offline: CTranslate2 (bench/enginebench/ct2.py's converter and `Worker`, as
bench-engine runs it) on the served translator's weights, in batches of BATCH sentences, as a case of its own,
interleaved with the others: what a user's offline batch job would get, against the service's throughput over HTTP.

- Weights: the repository's translator rebuilt in PyTorch (`repository.random_model`: the same preset and seed as the
  exported one), converted by `ct2.convert` into float32, once per repository.
- The work: the translation case's sentences as the token ids the service feeds its translator (its /tokenize, the
  end-of-source token included), BATCH consecutive ones per call, cycling through them; beam search with the case's
  beams and exactly its pinned number of new tokens (min = max decoding length); the benchmark's threads.
- The worker, a process of its own, is stopped (SIGSTOP) except while its case runs (`servers.run_alone`).
"""

from __future__ import annotations

from pathlib import Path

from .cases import OfflineCase
from .load import Workload
from .repository import random_model

BATCH = 16  # sentences per translate_batch call
COMPUTE_TYPE = "float32"
CASE_NAME = f"ctranslate2 b={BATCH}"
NOT_INSTALLED = "ctranslate2 is not installed (the dev extra's: pip install -e '.[dev]')"


def ctranslate2_worker(args, repository: Path):
    """A CTranslate2 worker (`ct2.Worker`) on the served translator, converted once into
    workdir/peers/<repository folder>/; ImportError (NOT_INSTALLED) without the ctranslate2 package."""
    import importlib.util

    if importlib.util.find_spec("ctranslate2") is None:
        raise ImportError(NOT_INSTALLED)
    from enginebench import ct2

    folder = args.workdir / "peers" / repository.name / f"ctranslate2-translation-{COMPUTE_TYPE}"
    return ct2.Worker(ct2.convert(random_model("translation"), folder), COMPUTE_TYPE, args.threads)


def batch_of(sources: list[list[int]], call: int) -> list[list[int]]:
    """The `call`-th batch: BATCH consecutive sources, cycling through them."""
    return [sources[(call * BATCH + i) % len(sources)] for i in range(BATCH)]


def ctranslate2_case(worker, sources: list[list[int]], num_beams: int, new_tokens: int) -> OfflineCase:
    """The offline case: each call translates `batch_of(sources, call)`; work = its sentences, each of which must
    have exactly `new_tokens` tokens (else the call is an error, like a short stream)."""

    def call(index: int) -> float:
        best = worker.translate(batch_of(sources, index), num_beams, new_tokens)
        lengths = {len(tokens) for tokens in best}
        if len(best) != BATCH or lengths != {new_tokens}:
            raise RuntimeError(f"CTranslate2 returned {len(best)} translations of {sorted(lengths)} tokens, "
                               f"expected {BATCH} of {new_tokens}")
        return float(len(best))

    endpoint = f"CTranslate2 translate_batch (offline, beam {num_beams}, {COMPUTE_TYPE})"
    return OfflineCase(CASE_NAME, endpoint, worker, Workload("translate_batch", [], {}, unit="sentences/s"), 1,
                       call=call)
