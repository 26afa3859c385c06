"""Request priority in the schedulers' queues: an integer level, lower served first (vLLM's convention), in
[0, levels); each model has a default level for requests that give none (TSERVE_DEFAULT_PRIORITY, per model).

- Order: a queue is served by level, then by arrival; a request that has waited `max_wait_s` counts as more urgent
  than every level (first come, first served among those), so no level starves: a request waits at most
  `max_wait_s` plus the time the requests that starved before it take to be admitted.
- Overload: a full queue refuses (429) its least urgent request, the newest of its lowest level: the newcomer if it
  is no more urgent than that one, else that waiting one, displaced.
- Running requests are never preempted: a batch keeps its rows. A request more urgent than the model's default may
  take `headroom_rows` rows beyond the batch's limit, so it joins at the next step even when every row is taken
  (requests admitted together and as long as each other would otherwise free their rows together, only at their
  end: docs/priority.md measures both).

Invariant: priority changes when a request runs, never what it computes (batch invariance).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.errors import BadInput

DEFAULT_LEVELS = 3  # 0 urgent, 1 normal (the default), 2 background
DEFAULT_PRIORITY = 1
DEFAULT_MAX_WAIT_S = 10.0  # after this long in a queue a request is served as the most urgent
DEFAULT_HEADROOM_ROWS = 8  # rows beyond a text batch's limit that only requests more urgent than the default take
STARVED = -1  # the rank level of a request that has waited `max_wait_s`: ahead of level 0


@dataclass(frozen=True)
class PriorityPolicy:
    """A model's priority levels, its default level and the wait after which any request is served first."""

    levels: int = DEFAULT_LEVELS
    default: int = DEFAULT_PRIORITY
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    headroom_rows: int = DEFAULT_HEADROOM_ROWS

    def __post_init__(self) -> None:
        if self.levels < 1 or not 0 <= self.default < self.levels:
            raise ValueError(f"priority default {self.default} is not a level of 0..{self.levels - 1}")
        if not self.max_wait_s > 0 or self.headroom_rows < 0:
            raise ValueError(f"max_wait_s must be > 0 and headroom_rows >= 0, got {self.max_wait_s}, "
                             f"{self.headroom_rows}")

    def level(self, value: int | None, param: str = "priority") -> int:
        """A request's level: `value`, or the default when None; 400 naming `param` outside [0, levels)."""
        if value is None:
            return self.default
        if not 0 <= value < self.levels:
            raise BadInput(f"{param} must be an integer from 0 (most urgent) to {self.levels - 1} "
                           f"(TSERVE_PRIORITY_LEVELS={self.levels}), got {value}", param=param)
        return value

    def row_limit(self, job, max_rows: int) -> int:
        """The rows a batch may hold once `job` joins it: `max_rows`, and the headroom for an urgent job."""
        return max_rows + (self.headroom_rows if job.priority < self.default else 0)

    def rank(self, job, now: float) -> tuple[int, float]:
        """Sort key of a waiting job (`priority`, `arrived`): lower is served first."""
        starved = now - job.arrived >= self.max_wait_s
        return (STARVED if starved else job.priority), job.arrived

    def ordered(self, waiting: Iterable, now: float) -> list:
        """The waiting jobs in the order they are served."""
        return sorted(waiting, key=lambda job: self.rank(job, now))

    def displaced(self, waiting: Iterable, newcomer, now: float):
        """In a full queue, the waiting job refused in favour of `newcomer` (the least urgent, newest), or None when
        the newcomer is no more urgent than every waiting job (the newcomer is refused)."""
        least = max(waiting, key=lambda job: self.rank(job, now), default=None)
        if least is None or self.rank(least, now)[0] <= newcomer.priority:
            return None
        return least
