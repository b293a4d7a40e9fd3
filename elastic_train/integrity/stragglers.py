"""Stragglers: a rank whose compute is slower than its peers' over a window of steps.

Per rank and step, the loop knows the time of the step's local part (worker/trainer.py: the
data and the forward passes; DDP's backward waits in the gradient all-reduce for the slowest
rank, so its time is the same on every rank). A slow rank computes longer while its peers
wait for it in the collective. A rank's typical time is the mean of its last ``window``
steps but the slowest (one checkpoint, page fault or hiccup in a window moves nothing); its
score, its typical time over the median of the others' (1.0: as fast as the rest); it is
named a straggler when its score is above ``factor``, and stays named until its score is
back below halfway to 1 (no flicker at the threshold). A mean, not a median: one step's
local part on a busy CPU is bimodal (the rank ran through, or was descheduled once: 7 or 20
ms on this project's 2-core machine with three ranks), and a median over a window jumps
between the modes where a mean does not. A rank slowed 2x is named about half a window after
its slowdown starts (3x: a quarter), and at every step it stays slow; no verdict before every
rank has a whole window.
The defaults name no rank of a healthy world on a noisy machine (tests/unit/test_integrity.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["DEFAULT_FACTOR", "DEFAULT_WINDOW", "StragglerWatch"]

DEFAULT_FACTOR = 1.5
DEFAULT_WINDOW = 50
"""Steps: at 20 or 30, three healthy ranks sharing two busy cores were named in 10,000-step
simulations of this machine's measured times (tests/unit/test_integrity.py); at 50, none."""


@dataclass
class StragglerWatch:
    """Feed it each step's compute times per rank; it names the slow ranks."""

    factor: float = DEFAULT_FACTOR
    window: int = DEFAULT_WINDOW
    scores: dict[int, float] = field(default_factory=dict)
    """Each rank's score at the last step (its typical time over the others')."""
    _history: dict[int, deque[float]] = field(default_factory=dict)
    _named: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError(f"straggler factor {self.factor}: above 1 (a rank slower than "
                             "its peers by that factor)")
        if self.window < 1:
            raise ValueError(f"straggler window {self.window}: at least 1 step")

    def step(self, compute_seconds: Mapping[int, float]) -> list[int]:
        """One step's compute time per rank; the ranks whose score is above ``factor``
        once every rank has ``window`` steps (a new set of ranks starts every window
        again: the world re-formed)."""
        if set(compute_seconds) != set(self._history):
            self._history = {r: deque(maxlen=self.window) for r in compute_seconds}
            self.scores, self._named = {}, set()
        for rank, seconds in compute_seconds.items():
            self._history[rank].append(seconds)
        if len(compute_seconds) < 2:
            return []
        typical = {r: _typical(h) for r, h in self._history.items()}
        for rank, own in typical.items():
            others = statistics.median(t for r, t in typical.items() if r != rank)
            self.scores[rank] = own / others if others > 0 else 1.0
        if any(len(h) < self.window for h in self._history.values()):
            return []
        still = 1.0 + (self.factor - 1.0) / 2
        self._named = {r for r, score in self.scores.items()
                       if score > self.factor or (r in self._named and score > still)}
        return sorted(self._named)

    def typical_seconds(self, rank: int) -> float:
        """``rank``'s typical compute time over its window so far (0.0 before any step)."""
        history = self._history.get(rank)
        return _typical(history) if history else 0.0


def _typical(history: deque[float]) -> float:
    """The mean of ``history`` but its largest value (while it holds more than two)."""
    values = sorted(history)
    if len(values) > 2:
        values = values[:-1]
    return sum(values) / len(values)
