"""Which policy version generates each turn of a rollout, and the seam that puts a version's
weights into the policy (partial rollouts, `train.partial_rollouts`).

A rollout of one version (every run but a partial one) generates all its turns with the weights
the policy holds. A partial rollout generates turn j of every episode (j counts from 0) with

    version(j) = min(last, first + j)                                    `TurnVersions.of`

so its first turns can start before the newer weights exist and its later turns use them. The
version of a turn is a function of the turn's index alone, never of when an update happened to
end, so the same run twice (or a run and its restart) generates the same turns with the same
weights. The engine (rollout/paged.py) changes weights only between turns: when no episode has a
turn left for the weights it holds, it asks `load` for the next version (which waits until it
exists), and every episode's K/V is recomputed under the new weights (its pages and the prefix
cache hold the K/V of one set of weights).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class TurnVersions:
    """first: the version of every episode's turn 0 (and of every turn when last == first).
    last: the newest version any turn uses (None: first). load(v): puts version v's weights into
    the engine's policy, waiting until v exists; raises (e.g. preemption.Preempted) to stop the
    rollout. Needed only when last > first."""

    first: int = 0
    last: int | None = None
    load: Callable[[int], None] | None = None

    def __post_init__(self):
        if self.last is not None and self.last < self.first:
            raise ValueError(f"TurnVersions: last={self.last} is older than first={self.first}")
        if self.newest > self.first and self.load is None:
            raise ValueError("TurnVersions with last > first needs `load` to put the newer versions into the policy")

    @property
    def newest(self) -> int:
        return self.first if self.last is None else self.last

    def of(self, turn: int) -> int:
        """The version that generates turn `turn` (0-based) of an episode."""
        return min(self.newest, self.first + turn)
