"""The continuous batcher on the tiny ONNX models: requests joining and leaving a running batch at step
boundaries decode exactly as they would alone; cancellation, deadlines and the bounded queue."""

import time

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, SamplingSearch
from service.engines.gpt import GPTEngine
from service.engines.translation import TranslationEngine
from service.errors import Cancelled, DeadlineExceeded, QueueFull
from service.repository import ModelRepository
from service.observability.metrics import Metrics
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.jobs import TextJob
from service.settings import Settings
from tests.support.waiting import PATIENCE_S

pytestmark = pytest.mark.slow

DEFAULTS = Settings.model_construct()  # the declared defaults, whatever the environment says
LIMITS = {"max_rows": DEFAULTS.gpt_max_batch_rows, "max_prefill": DEFAULTS.max_prefill_requests,
          "max_queue": DEFAULTS.max_queue_size}  # a test's own options replace these

PROMPTS = ["ROMEO:", "To be or not", "KING:\nWhat", "A", "First Citizen:\nWe", "O", "Speak, speak.", "\n\n"]
GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Kinder laufen am Strand.", "Eine Frau singt.",
          "Ein kleines Mädchen klettert in ein Spielhaus aus Holz."]


@pytest.fixture(scope="module")
def gpt(tiny_repository):
    return GPTEngine(ModelRepository(tiny_repository).get("gpt"))


@pytest.fixture(scope="module")
def translation(tiny_repository):
    return TranslationEngine(ModelRepository(tiny_repository).get("translation"))


@pytest.fixture
def batcher_for():
    started = []

    def make(engine, **options):
        batcher = ContinuousBatcher(engine, "m", 1, Metrics(), **{**LIMITS, **options})
        batcher.start()
        started.append(batcher)
        return batcher

    yield make
    for batcher in started:
        batcher.stop(timeout=PATIENCE_S)


def submit_staggered(batcher, inputs, make_search, pause=0.002):
    jobs = []
    for i, ids in enumerate(inputs):
        jobs.append(batcher.submit(TextJob(ids, make_search(i), "x", time.monotonic() + 60)))
        time.sleep(pause * (i % 4))  # some arrive together, some join a running batch
    return [job.future.result(timeout=PATIENCE_S) for job in jobs]


@pytest.mark.parametrize("workers", [1, 2])
def test_gpt_requests_joining_and_leaving_decode_as_if_alone(gpt, batcher_for, workers):
    prompts = [gpt.tokenizer.encode(p).ids for p in PROMPTS * 3]

    def make(i):  # different lengths, so requests leave at different steps
        kind = i % 3
        if kind == 0:
            return GreedySearch(8 + 3 * (i % 7), gpt.eos_id)
        if kind == 1:
            return BeamSearch(3, 6 + i % 5, gpt.eos_id, prefix=prompts[i])
        return SamplingSearch(10 + i % 9, gpt.eos_id, temperature=0.8, top_k=30, seed=i)

    batched = submit_staggered(batcher_for(gpt, max_rows=24, max_prefill=4, workers=workers), prompts, make)
    for i, prompt in enumerate(prompts):
        alone = gpt.generate([prompt], lambda _: make(i))[0].results()
        assert [(h.tokens, h.finish_reason) for h in alone] == [(h.tokens, h.finish_reason) for h in batched[i]]
        assert np.allclose([h.score for h in alone], [h.score for h in batched[i]], atol=1e-4)


@pytest.mark.parametrize("workers", [1, 2])
def test_translations_joining_and_leaving_decode_as_if_alone(translation, batcher_for, workers):
    sources = [translation.source_ids(s) for s in GERMAN * 3]

    def make(i):
        if i % 2:
            return GreedySearch(translation.default_max_new_tokens(len(sources[i])), translation.eos_id)
        return BeamSearch(4, 25, translation.eos_id, num_return_sequences=2, prefix=[translation.bos_id])

    batched = submit_staggered(batcher_for(translation, max_rows=20, max_prefill=3, workers=workers), sources, make)
    for i, source in enumerate(sources):
        alone = translation.translate_ids([source], lambda _: make(i))[0].results()
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]


def test_cancelled_and_expired_requests_leave_and_the_rest_go_on(gpt, batcher_for):
    batcher = batcher_for(gpt, max_rows=8)
    prompt = gpt.tokenizer.encode("ROMEO:").ids
    long_job = batcher.submit(TextJob(prompt, GreedySearch(50, gpt.eos_id), "greedy", time.monotonic() + 60))
    doomed = batcher.submit(TextJob(prompt, GreedySearch(50, gpt.eos_id), "greedy", time.monotonic() - 0.001))
    gone = batcher.submit(TextJob(prompt, GreedySearch(50, gpt.eos_id), "greedy", time.monotonic() + 60))
    gone.cancel()
    with pytest.raises(Cancelled):
        gone.future.result(timeout=PATIENCE_S)
    with pytest.raises(DeadlineExceeded):
        doomed.future.result(timeout=PATIENCE_S)
    expected = gpt.generate([prompt], lambda _: GreedySearch(50, gpt.eos_id))[0].results()[0].tokens
    assert long_job.future.result(timeout=PATIENCE_S)[0].tokens == expected
    deadline = time.monotonic() + 5
    while batcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher.running == 0 and batcher.queue_depth == 0


def test_a_full_queue_refuses_with_a_retry_hint(gpt):
    batcher = ContinuousBatcher(gpt, "m", 1, Metrics(), **{**LIMITS, "max_queue": 2})  # not started: nothing leaves the queue
    prompt = gpt.tokenizer.encode("A").ids
    for _ in range(2):
        batcher.submit(TextJob(prompt, GreedySearch(5, gpt.eos_id), "greedy", time.monotonic() + 60))
    with pytest.raises(QueueFull) as refused:
        batcher.submit(TextJob(prompt, GreedySearch(5, gpt.eos_id), "greedy", time.monotonic() + 60))
    assert int(refused.value.headers["Retry-After"]) >= 1
