"""``--straggler-policy warn``: which rank computes slower than its peers (issue 41's
stragglers), from the timings the step already has and the vote it already makes.

Each rank measures its step's local part (worker/trainer.py: the data and the forward
passes, which wait on no other rank under DDP) and puts it in its own slot of the step's
vote (worker/vote.py: one all-reduce that every step makes anyway; one float64 per rank
more, no extra synchronisation). Every rank then holds every rank's time, scores them the
same way (integrity/stragglers.py) and names the same ranks at the same step. A rank named
is said once per streak: one line (rank 0), a ``straggler`` event and the metric
``elastic_train_stragglers_total`` with the rank and its node; its own score is a gauge on
every rank (``elastic_train_straggler_score``). It trains on: eviction is not built yet.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref

import torch

from elastic_train.events.log import EventLog
from elastic_train.events.schema import Straggler
from elastic_train.integrity.stragglers import StragglerWatch
from elastic_train.worker.distributed import Group, HostNames

__all__ = ["StragglerCheck"]

log = logging.getLogger(__name__)


class StragglerCheck:
    """One worker's part of ``--straggler-policy`` (``policy`` off: nothing measured)."""

    def __init__(self, policy: str, factor: float, window: int, events: EventLog) -> None:
        self.policy = policy
        self.enabled = policy != "off"
        self.watch = StragglerWatch(factor, window)
        self.events = events
        self.compute_seconds = 0.0
        """This rank's local part of the step in flight (then in its vote)."""
        self.score: float | None = None
        """This rank's score at the last vote (None: not measured, or alone)."""
        self._named: set[int] = set()
        self._hosts = HostNames()
        self._group: weakref.ref[Group] | None = None
        self._began = 0.0

    # ---- measured by the loop ------------------------------------------------------------
    def start(self) -> None:
        """A step starts: its local part is timed from now."""
        self.compute_seconds, self.score = 0.0, None
        self._began = time.perf_counter()

    def pause(self) -> None:
        """The step's local part pauses (DDP's backward: it waits for every rank)."""
        self.compute_seconds += time.perf_counter() - self._began

    def resume(self) -> None:
        self._began = time.perf_counter()

    @property
    def measured(self) -> float | None:
        """The last step's local part, in seconds, while on (for its step event)."""
        return self.compute_seconds if self.enabled else None

    # ---- the vote's part -----------------------------------------------------------------
    def slots(self, world_size: int) -> int:
        """The vote's slots this check adds: one per rank, while on."""
        return world_size if self.enabled else 0

    def put(self, tally: torch.Tensor, base: int, rank: int) -> None:
        """This rank's compute time in its slot (the others stay 0: the sum is every one's)."""
        if self.enabled:
            tally[base + rank] = self.compute_seconds

    def read(self, values: list[float], base: int, group: Group, step: int) -> list[int]:
        """Every rank, from the vote's sum: score every rank, name the slow ones (the same
        on every rank); the ranks named now."""
        if not self.enabled:
            return []
        times = {r: values[base + r] for r in range(group.world_size)}
        if self._group is None or self._group() is not group:
            # a new world (re-formed in place: a member that joined has no history): every
            # rank starts its windows again, so that all name the same ranks at one step
            self.watch = StragglerWatch(self.watch.factor, self.watch.window)
            self._named, self._group = set(), weakref.ref(group)
        if any(t <= 0 for t in times.values()):  # a loop that measured nothing: no verdict
            self.score = None
            return []
        named = self.watch.step(times)
        self.score = self.watch.scores.get(group.rank)
        new = [r for r in named if r not in self._named]
        self._named = set(named)
        if new:
            hosts = self._hosts.of(group)  # a collective: every rank names the same ranks
            for rank in new:
                self._say(group, step, rank, hosts[rank], times)
        return new

    def _say(self, group: Group, step: int, rank: int, node: str, times: dict[int, float]
             ) -> None:
        own = self.watch.typical_seconds(rank)
        others = statistics.median(self.watch.typical_seconds(r) for r in times if r != rank)
        score = self.watch.scores[rank]
        self.events.emit(Straggler(step=step, rank=rank, node=node, score=round(score, 3),
                                   compute_seconds=round(own, 6),
                                   others_seconds=round(others, 6),
                                   factor=self.watch.factor, window=self.watch.window,
                                   policy=self.policy))
        if group.rank == 0:
            log.warning("straggler: rank %d (host %s) computes %.2fx as long as the others "
                        "(means over the last %d steps to step %d: %.4f s against %.4f s): "
                        "--straggler-policy %s: it trains on", rank, node, score,
                        self.watch.window, step, own, others, self.policy)
