"""Token streams from the scheduler to a response, for any API: the scheduler thread hands each request's new
tokens to the event loop (one loop wake-up per decoding step for all streams: `service.serving.handoff`), and each
choice's text grows in O(1) per token through its own incremental detokeniser (`service.decoding.Detokenizer`,
TGI's `decode_token`: a token is held back while it ends in half a UTF-8 character), the one its stop strings read.

A piece of text is released only once it can no longer change: text that could still turn into a stop string is
held back until it cannot, so concatenating the pieces gives exactly the final (stop-truncated) text. The events
are API-neutral (`Piece`, `Finished`); each API formats them as its own server-sent events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from service.decoding import StopStrings, truncate_at_stop
from service.errors import ServiceError
from service.observability import tracing
from service.scheduling.jobs import TextJob
from service.serving.handoff import mailbox_for
from service.serving.outputs import Completion


@dataclass
class Piece:
    """New output of one choice: the tokens that arrived (with their log-probabilities when asked for) and the
    text that became final (possibly empty, possibly text of earlier tokens)."""

    choice: int
    text: str
    token_ids: list[int]
    logprobs: list | None = None  # TokenLogprob per token, when the search records them


@dataclass
class Finished:
    """The end of one choice: its completion, or the error that ended it (the status was already sent)."""

    choice: int
    completion: Completion | None = None
    error: ServiceError | None = None
    rest: str = ""  # the final text not released by a Piece yet


class IncrementalText:
    """Token ids -> text pieces whose concatenation is the final text, decoding each token once.

    Only the text that can still become a stop string is held back: the longest end of the text so far that is
    the start of a stop string (`StopStrings.held_back`). Released text therefore never holds the start of a stop
    string, so an occurrence lies wholly in the held-back text plus the newest tokens' text (`pending`), shorter
    than the longest stop string plus the new text: each `add` looks at that window only, never at the whole
    text, and cuts where `truncate_at_stop` cuts the final text (the earliest occurrence of any stop string)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.stops = StopStrings(stops, tokenizer.decode)  # its `text`: this choice's detokeniser
        self.pending = ""  # decoded, not released (may still be the start of a stop string)
        self.released = 0  # characters released so far
        self.stopped = False

    def add(self, ids: Sequence[int]) -> str:
        """Decode the new tokens; the text that is now final (nothing more once a stop string was found)."""
        if self.stopped:
            return ""
        self.pending += self.stops.text.add(ids)
        cut, hit = truncate_at_stop(self.pending, self.stops.stops)
        stable = len(cut) if hit else len(self.pending) - self.stops.held_back(self.pending)
        piece, self.pending = self.pending[:stable], self.pending[stable:]
        self.stopped = hit
        self.released += len(piece)
        return piece

    def finish(self, final_text: str) -> str:
        """What is left to release of the final text."""
        return final_text[self.released :]


def stream_jobs(loaded, jobs: Sequence[TextJob], texts: Sequence[IncrementalText],
                complete) -> AsyncIterator[list[Piece | Finished]]:
    """Submit `jobs` (choice i = jobs[i]) and yield, at every wake-up, the events that arrived since the last one.
    `complete(choice, hypothesis) -> Completion` builds a finished choice. The jobs are submitted when this is
    called, not when iteration starts, so that a full queue is still a 429 before any response; leaving the
    iteration early (the client went away) cancels every job."""
    mailbox = mailbox_for(asyncio.get_running_loop())
    updates: asyncio.Queue = asyncio.Queue()
    for choice, job in enumerate(jobs):
        job.on_tokens = lambda ids, logprobs, choice=choice: mailbox.put(updates, (choice, ids, logprobs))
        job.future.add_done_callback(lambda _, choice=choice: mailbox.put(updates, (choice, None, None)))
    submit(loaded, jobs)
    return _events(jobs, texts, complete, updates, tracing.text_spans(loaded, jobs))


async def _events(jobs, texts, complete, updates: asyncio.Queue, spans) -> AsyncIterator[list[Piece | Finished]]:
    open_choices = set(range(len(jobs)))
    try:
        while open_choices:
            arrived = [await updates.get()]
            while not updates.empty():
                arrived.append(updates.get_nowait())
            events: list[Piece | Finished] = []
            for choice, ids, logprobs in arrived:
                job = jobs[choice]
                if ids is not None:
                    events.append(Piece(choice, texts[choice].add(ids), list(ids), logprobs))
                    continue
                open_choices.discard(choice)
                try:
                    hypothesis = job.future.result()[0]
                except ServiceError as error:
                    events.append(Finished(choice, error=error))
                else:
                    completion = complete(choice, hypothesis)
                    events.append(Finished(choice, completion, rest=texts[choice].finish(completion.text)))
            yield events
    finally:
        for job in jobs:
            job.cancel()  # no-op for finished jobs; frees the rows of the others when the client went away
        spans.record()  # the jobs' phase spans (tracing on), children of the request's span


def submit(loaded, jobs: Sequence[TextJob]) -> None:
    """Submit every job, or none: if the queue refuses one, the ones already queued are cancelled."""
    try:
        for job in jobs:
            loaded.scheduler.submit(job)
    except ServiceError:
        for job in jobs:
            job.cancel()
        raise
