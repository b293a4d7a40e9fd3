"""Stragglers: a rank whose compute is slower than its peers' for a window of steps.

Per rank and step, the loop already knows its compute time (forward, backward, optimizer)
and the time it waited in the collective; a slow rank computes longer and waits less, its
peers wait for it. The score of a rank is its compute time over the median of the others'
(1.0: as fast as the rest). A rank is named a straggler when its score is above
``factor`` for ``window`` consecutive steps: one slow step (a page fault, a checkpoint, a
noisy neighbour for a moment) is no straggler. The defaults name no rank of a healthy
world on a noisy machine and a rank slowed 2x within ``window`` steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

POLICIES = ("off", "warn", "evict")
DEFAULT_FACTOR = 1.5
DEFAULT_WINDOW = 20


@dataclass
class StragglerWatch:
    """Feed it each step's compute times; it names the ranks slow for ``window`` steps."""

    factor: float = DEFAULT_FACTOR
    window: int = DEFAULT_WINDOW
    scores: dict[int, float] = field(default_factory=dict)
    """Each rank's score at the last step (its compute time over the others' median)."""
    _streak: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError(f"straggler factor {self.factor}: above 1 (a rank slower than "
                             "its peers by that factor)")
        if self.window < 1:
            raise ValueError(f"straggler window {self.window}: at least 1 step")

    def step(self, compute_seconds: Mapping[int, float]) -> list[int]:
        """One step's compute time per rank; the ranks slow for ``window`` steps in a row
        (named again at every step they stay so)."""
        if len(compute_seconds) < 2:
            self.scores, self._streak = {}, {}
            return []
        named = []
        for rank, seconds in compute_seconds.items():
            others = [s for r, s in compute_seconds.items() if r != rank]
            median = statistics.median(others)
            score = seconds / median if median > 0 else 1.0
            self.scores[rank] = score
            self._streak[rank] = self._streak.get(rank, 0) + 1 if score > self.factor else 0
            if self._streak[rank] >= self.window:
                named.append(rank)
        for gone in set(self._streak) - set(compute_seconds):
            self._streak.pop(gone, None)
            self.scores.pop(gone, None)
        return sorted(named)
