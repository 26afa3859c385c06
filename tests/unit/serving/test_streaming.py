"""The API-neutral token stream (`service.serving.streaming`) without a model or a server: a fake scheduler takes the
jobs and its worker thread hands their tokens back as the real one does (`on_tokens`, then the future).

A stream yields each choice's text as pieces that concatenate to its final text (nothing of a stop string, nothing
past it), the tokens as they arrived, and one `Finished` per choice: its completion and the text not released yet,
or the error that ended that choice alone; leaving the stream early cancels every job, and a queue that refuses one
job leaves none of them queued.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from models.tokenization import build_byte_tokenizer
from service.decoding import GreedySearch, Hypothesis, truncate_at_stop
from service.errors import BadInput, QueueFull
from service.scheduling.jobs import TextJob
from service.serving.outputs import Completion
from service.serving.streaming import Finished, IncrementalText, Piece, stream_jobs


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()  # the served GPT's: one token per UTF-8 byte


class FakeScheduler:
    """Records the submitted jobs; refuses the job at index `refuse` with a 429."""

    def __init__(self, refuse: int | None = None):
        self.jobs: list[TextJob] = []
        self.refuse = refuse

    def submit(self, job: TextJob) -> None:
        if len(self.jobs) == self.refuse:
            raise QueueFull("queue full", retry_after_s=1.0)
        self.jobs.append(job)


def job() -> TextJob:
    return TextJob(input_ids=[1], search=GreedySearch(max_new_tokens=32, eos_token_id=0), mode="greedy",
                   deadline=float("inf"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def run_worker(steps) -> threading.Thread:
    """The scheduler's worker thread: each step is called in order, off the event loop."""
    thread = threading.Thread(target=lambda: [step() for step in steps])
    thread.start()
    return thread


async def collect(stream) -> list[Piece | Finished]:
    return [event async for events in stream for event in events]


def test_pieces_concatenate_to_the_final_text_and_each_choice_ends_alone(tokenizer):
    stops = ["\n\n"]
    jobs, scheduler = [job(), job()], FakeScheduler()
    texts = [IncrementalText(tokenizer, stops), IncrementalText(tokenizer, stops)]
    first, second, third = ids(tokenizer, "To be\n"), ids(tokenizer, "\nor not"), ids(tokenizer, "caf\u00e9")
    tokens = first + second

    def complete(choice, hypothesis):
        text, _ = truncate_at_stop(tokenizer.decode(hypothesis.tokens), stops)
        return Completion(text=text, token_ids=hypothesis.tokens, finish_reason=hypothesis.finish_reason,
                          score=hypothesis.score, prompt_tokens=1)

    async def main():
        stream = stream_jobs(SimpleNamespace(scheduler=scheduler), jobs, texts, complete)
        assert scheduler.jobs == jobs  # submitted when called, before any iteration
        worker = run_worker([
            lambda: jobs[0].on_tokens(first, None),
            lambda: jobs[1].on_tokens(third, None),
            lambda: jobs[0].on_tokens(second, None),
            lambda: jobs[0].future.set_result([Hypothesis(tokens=tokens, score=-1.5, finish_reason="stop")]),
            lambda: jobs[1].future.set_exception(BadInput("too long")),
        ])
        events = await collect(stream)
        worker.join()
        return events

    events = asyncio.run(main())
    pieces = {c: [e for e in events if isinstance(e, Piece) and e.choice == c] for c in (0, 1)}
    finished = {e.choice: e for e in events if isinstance(e, Finished)}
    assert [p.token_ids for p in pieces[0]] == [first, second]
    assert [p.token_ids for p in pieces[1]] == [third]
    assert "".join(p.text for p in pieces[0]) == "To be"  # "\n" held back, then the stop string: nothing after
    assert pieces[0][0].text == "To be"
    assert "".join(p.text for p in pieces[1]) == "caf\u00e9"
    assert sorted(finished) == [0, 1] and isinstance(events[-1], Finished)
    done = finished[0]
    assert done.error is None and done.completion.text == "To be" and done.completion.finish_reason == "stop"
    assert done.rest == ""  # every character of the final text was released as a piece
    assert finished[1].completion is None and isinstance(finished[1].error, BadInput)
    assert all(j.cancelled.is_set() for j in jobs)  # a no-op for finished jobs


def test_the_rest_is_the_final_text_not_released_yet(tokenizer):
    """A held-back start of a stop string that never became one is released by `Finished.rest`."""
    text = IncrementalText(tokenizer, ["END"])
    assert text.add(ids(tokenizer, "the EN")) == "the "
    assert text.finish("the EN") == "EN"
    assert text.released == 4


def test_nothing_is_released_after_a_stop_string(tokenizer):
    text = IncrementalText(tokenizer, ["!"])
    assert text.add(ids(tokenizer, "hi! there")) == "hi"
    assert text.stopped
    assert text.add(ids(tokenizer, "more")) == ""
    assert text.finish("hi") == ""


def test_leaving_the_stream_early_cancels_every_job(tokenizer):
    jobs, scheduler = [job(), job()], FakeScheduler()
    texts = [IncrementalText(tokenizer), IncrementalText(tokenizer)]

    async def main():
        stream = stream_jobs(SimpleNamespace(scheduler=scheduler), jobs, texts, complete=None)
        worker = run_worker([lambda: jobs[0].on_tokens(ids(tokenizer, "a"), None)])
        async for events in stream:
            assert [(e.choice, e.text) for e in events] == [(0, "a")]
            break  # the client went away
        await stream.aclose()
        worker.join()

    asyncio.run(main())
    assert all(j.cancelled.is_set() for j in jobs)
    assert not any(j.future.done() for j in jobs)


def test_a_refused_job_leaves_none_queued(tokenizer):
    jobs, scheduler = [job(), job(), job()], FakeScheduler(refuse=1)
    texts = [IncrementalText(tokenizer) for _ in jobs]

    async def main():
        with pytest.raises(QueueFull):
            stream_jobs(SimpleNamespace(scheduler=scheduler), jobs, texts, complete=None)

    asyncio.run(main())
    assert scheduler.jobs == jobs[:1]
    assert all(j.cancelled.is_set() for j in jobs)


def test_a_finished_choice_carries_its_rest_its_logprobs_and_its_own_index(tokenizer):
    """Choice 1 ends on "EN", the start of its stop string "END" that never came: `Finished.rest` releases it; the
    pieces carry the log-probabilities the scheduler handed over; `complete` is asked for that choice."""
    jobs, scheduler = [job(), job()], FakeScheduler()
    texts = [IncrementalText(tokenizer), IncrementalText(tokenizer, ["END"])]
    tokens, logprobs = ids(tokenizer, "the EN"), [object() for _ in range(6)]
    asked = []

    def complete(choice, hypothesis):
        asked.append(choice)
        return Completion(text=tokenizer.decode(hypothesis.tokens), token_ids=hypothesis.tokens,
                          finish_reason="length", score=0.0, prompt_tokens=1)

    async def main():
        stream = stream_jobs(SimpleNamespace(scheduler=scheduler), jobs, texts, complete)
        worker = run_worker([
            lambda: jobs[1].on_tokens(tokens, logprobs),
            lambda: jobs[1].future.set_result([Hypothesis(tokens=tokens, score=0.0, finish_reason="length")]),
            lambda: jobs[0].future.set_exception(BadInput("gone")),
        ])
        events = await collect(stream)
        worker.join()
        return events

    events = asyncio.run(main())
    (piece,) = [e for e in events if isinstance(e, Piece)]
    assert (piece.choice, piece.text, piece.logprobs) == (1, "the ", logprobs)
    (done,) = [e for e in events if isinstance(e, Finished) and e.choice == 1]
    assert done.rest == "EN" and done.completion.text == "the EN"
    assert asked == [1]
