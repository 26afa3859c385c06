"""A fake numpy decoding backend for the scheduler and batch tests (no ONNX, fast).

The fake model's next-token logits are a deterministic function of a row's whole history, so a request decodes to
the same tokens alone or in any batch, and a wrong row selection or a lost row shows up as a different output.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from service.decoding import GreedySearch, run_search
from tests.support.waiting import PATIENCE_S

VOCAB, EOS, POISON = 12, 0, 11  # a prompt holding POISON makes the prefill raise
RESULT_TIMEOUT_S = PATIENCE_S  # how long a test waits for a job's result


def extend(history: int, token: int) -> int:
    """A row's history as a rolling hash: the same tokens, the same value (O(1) per token, any length)."""
    return hash((history, int(token))) % 2**61


def history_of(ids) -> int:
    history = 0
    for token in ids:
        history = extend(history, token)
    return history


def logits_of(history: int) -> np.ndarray:
    """The fake model: next-token logits (V,) from a row's whole history."""
    return np.random.default_rng(history % 2**32).standard_normal(VOCAB)


@dataclass
class FakeState:
    histories: list[int]
    positions: np.ndarray  # `recycle` zeroes dead rows' positions in place

    @property
    def rows(self) -> int:
        return len(self.histories)


class FakeBackend:
    """`DecodingBackend` over `logits_of`. Records the rows of every step; `gate` can hold a step (to pile up a
    queue or race `stop()`); `fail_step` makes the next step raise."""

    def __init__(self):
        self.step_rows: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.fail_step = False
        self.scored_passes: list[list[int]] = []  # the rows of each prompt pass that scored prompts

    def prefill(self, inputs):
        if any(POISON in ids for ids in inputs):
            raise RuntimeError("poisoned prompt")
        histories = [history_of(ids) for ids in inputs]
        return np.stack([logits_of(h) for h in histories]), FakeState(histories, np.ones(len(histories), np.int64))

    def prefill_positions(self, inputs, rows):
        """`prefill`, and for `rows` the logits at every prompt position: position t's from the history of the
        prompt's first t + 1 tokens (as the GPT's prompt pass gives them)."""
        self.scored_passes.append(sorted(rows))
        logits, state = self.prefill(inputs)
        return logits, state, {row: np.stack([logits_of(history_of(inputs[row][: t + 1]))
                                              for t in range(len(inputs[row]))]) for row in rows}

    def step(self, state, tokens):
        self.in_step.set()
        assert self.gate.wait(timeout=RESULT_TIMEOUT_S), "the test never opened the gate"
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("step failed")
        self.step_rows.append(state.rows)
        state.histories = [extend(h, t) for h, t in zip(state.histories, tokens)]
        return np.stack([logits_of(h) for h in state.histories])

    def recycle(self, state, rows):
        state.positions[rows] = 0

    def select(self, state, rows):
        return FakeState([state.histories[r] for r in rows], state.positions[rows].copy())

    def concatenate(self, states, rows=None):
        rows = rows or [None] * len(states)
        histories, positions = [], []
        for state, keep in zip(states, rows):
            keep = np.arange(state.rows) if keep is None else keep
            histories += [state.histories[r] for r in keep]
            positions.append(state.positions[keep])
        return FakeState(histories, np.concatenate(positions))


def alone(prompt: list[int], search) -> list[tuple[list[int], str]]:
    """What `search` gives for `prompt` decoded by itself (the reference driver, no scheduler)."""
    histories = [history_of(prompt)]

    def step_fn(tokens, parents):
        nonlocal histories
        histories = [extend(histories[p], t) for t, p in zip(tokens, parents)]
        return np.stack([logits_of(h) for h in histories])

    run_search([search], [logits_of(histories[0])], step_fn)
    return [(h.tokens, h.finish_reason) for h in search.results()]


class ExplodingSearch(GreedySearch):
    """A greedy search that raises on its `explode_at`-th step (no EOS: it cannot finish before)."""

    def __init__(self, max_new_tokens: int, explode_at: int):
        assert explode_at <= max_new_tokens
        super().__init__(max_new_tokens, None)
        self.explode_at, self.steps = explode_at, 0

    def accept(self, *args):
        self.steps += 1
        if self.steps == self.explode_at:
            raise ValueError("search exploded")
        return super().accept(*args)
