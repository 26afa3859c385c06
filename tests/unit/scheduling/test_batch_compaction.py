"""When the running batch drops its dead rows (`TextBatch._plan`, `TextBatch.concatenate`), on the fake backend:
a step with at most a quarter of its rows dead runs in place, its dead rows (only them) recycled; one with more
compacts; concatenating drops dead rows, a batch without any is kept as is, and batches with no request left merge
into an empty batch. Every request decodes as it does alone throughout."""

from __future__ import annotations

from service.decoding import GreedySearch
from service.scheduling.text_batch import TextBatch
from tests.support.batchers import job
from tests.support.fake_decoding import FakeBackend, alone

PROMPTS = [[1, 2], [3, 4], [5, 6], [7, 8]]
TOKENS = 6


def jobs_of(prompts):
    return [job(p, GreedySearch(TOKENS, None)) for p in prompts]


def finish(batch: TextBatch) -> None:
    while batch.jobs:
        batch.filter([g.job for g in batch.generate_token() if not g.done])


def decoded_as_alone(jobs) -> bool:
    return all([(h.tokens, h.finish_reason) for h in j.search.results()]
               == alone(j.input_ids, GreedySearch(TOKENS, None)) for j in jobs)


def test_a_quarter_of_dead_rows_is_stepped_in_place_and_recycled_more_is_compacted():
    backend = FakeBackend()
    jobs = jobs_of(PROMPTS)
    batch, _ = TextBatch.prefill(backend, jobs)
    batch.filter([jobs[0], jobs[2], jobs[3]])  # row 1 dead: a quarter of the rows
    batch.generate_token()
    assert backend.step_rows == [4]
    assert batch.state.positions.tolist() == [1, 0, 1, 1]  # the dead row recycled, the live ones untouched
    batch.filter([jobs[0], jobs[3]])  # half of the rows dead
    batch.generate_token()
    assert backend.step_rows == [4, 2] and batch.rows == 2
    finish(batch)
    assert decoded_as_alone([jobs[0], jobs[3]])


def test_concatenating_drops_dead_rows_and_keeps_a_batch_without_any():
    backend = FakeBackend()
    jobs = jobs_of(PROMPTS[:2])
    batch, _ = TextBatch.prefill(backend, jobs)
    assert TextBatch.concatenate([batch]) is batch  # nothing to drop
    batch.filter([jobs[1]])
    merged = TextBatch.concatenate([batch])
    assert merged.rows == merged.live_rows == 1 and merged.jobs == [jobs[1]]
    finish(merged)
    assert backend.step_rows[0] == 1 and decoded_as_alone([jobs[1]])


def test_batches_with_no_request_left_merge_into_an_empty_batch():
    backend = FakeBackend()
    batch, _ = TextBatch.prefill(backend, jobs_of(PROMPTS[:2]))
    batch.filter([])
    merged = TextBatch.concatenate([batch])
    assert merged.jobs == [] and merged.rows == merged.live_rows == 0
    assert merged.row_indices().tolist() == []
