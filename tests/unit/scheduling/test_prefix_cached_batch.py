"""A backend with a prefix cache in the batch and the scheduler (fake backend): `TextBatch.prefill` takes each job's
cached tokens and its prompt scores from one `prefill_cached` pass, the generations are those of the prompt alone,
and the batcher counts the tokens looked up and found, the blocks evicted since the last prefill and the bytes held
(`PrefixCacheMetrics`). The cache's own numbers are tests/unit/engines/test_prefix_cache.py's."""

from __future__ import annotations

from types import SimpleNamespace

from service.decoding import GreedySearch
from service.observability.metrics import Metrics
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.prefix_metrics import PrefixCacheMetrics
from service.scheduling.text_batch import TextBatch, score_prompt
from tests.support.batchers import LIMITS, job
from tests.support.fake_decoding import RESULT_TIMEOUT_S, FakeBackend, alone
from tests.support.metrics import metric

LABELS = {"model": "m", "version": "1"}


class CachedBackend(FakeBackend):
    """`FakeBackend` whose prompt pass says half of each prompt (rounded down) came from a cache of `stats`."""

    def __init__(self):
        super().__init__()
        self.prefix_cache = SimpleNamespace(stats=SimpleNamespace(evicted_blocks=0, bytes=0))
        self.cached_passes: list[list[int]] = []

    def prefill_cached(self, inputs, rows):
        self.cached_passes.append(sorted(rows))
        self.prefix_cache.stats.evicted_blocks += 2
        self.prefix_cache.stats.bytes = 1000 * len(inputs)
        logits, state, every = self.prefill_positions(inputs, rows)
        return logits, state, every, [len(ids) // 2 for ids in inputs]


def test_the_batch_takes_cached_tokens_and_prompt_scores_from_one_cached_pass():
    backend = CachedBackend()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3]]
    jobs = [job(p, GreedySearch(4, None), prompt_logprobs=2 if i == 1 else None) for i, p in enumerate(prompts)]
    batch, generations = TextBatch.prefill(backend, jobs)
    assert backend.cached_passes == [[1]] and backend.scored_passes == [[1]]
    assert [j.cached_tokens for j in jobs] == [2, 1, 1]
    assert jobs[0].prompt_scores is None and jobs[2].prompt_scores is None
    _, _, every = FakeBackend().prefill_positions([prompts[1]], [0])
    assert jobs[1].prompt_scores == score_prompt(prompts[1], every[0], 2)
    while not all(g.done for g in generations):
        generations = batch.generate_token()
    for j, prompt in zip(jobs, prompts):
        assert [(h.tokens, h.finish_reason) for h in j.search.results()] == alone(prompt, GreedySearch(4, None))


def test_the_batcher_counts_tokens_looked_up_and_found_evictions_and_bytes():
    metrics = Metrics()
    backend = CachedBackend()
    batcher = ContinuousBatcher(backend, "m", 1, metrics, **LIMITS)
    batcher.start()
    try:
        for prompt in ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10]):
            batcher.submit(job(prompt, GreedySearch(2, None))).future.result(timeout=RESULT_TIMEOUT_S)
    finally:
        batcher.stop(timeout=RESULT_TIMEOUT_S)
    samples = [s for family in metrics.registry.collect() for s in family.samples]
    assert metric(samples, "tserve_prefix_cache_queries_total", **LABELS) == 10
    assert metric(samples, "tserve_prefix_cache_hits_total", **LABELS) == 2 + 3
    assert metric(samples, "tserve_prefix_cache_evictions_total", **LABELS) == 4
    assert metric(samples, "tserve_prefix_cache_bytes", **LABELS) == 1000


def test_prefix_metrics_count_evictions_once_and_exist_only_for_a_cache():
    metrics = Metrics()
    assert PrefixCacheMetrics.of(FakeBackend(), metrics, LABELS) is None
    backend = CachedBackend()
    observed = PrefixCacheMetrics.of(backend, metrics, LABELS)
    backend.prefix_cache.stats.evicted_blocks, backend.prefix_cache.stats.bytes = 5, 77
    observed.observe([])
    observed.observe([])
    backend.prefix_cache.stats.evicted_blocks = 7
    first = job([1, 2, 3], GreedySearch(1, None))
    first.cached_tokens = 2
    observed.observe([first])
    samples = [s for family in metrics.registry.collect() for s in family.samples]
    assert metric(samples, "tserve_prefix_cache_evictions_total", **LABELS) == 7
    assert metric(samples, "tserve_prefix_cache_bytes", **LABELS) == 77
    assert metric(samples, "tserve_prefix_cache_queries_total", **LABELS) == 3
    assert metric(samples, "tserve_prefix_cache_hits_total", **LABELS) == 2
