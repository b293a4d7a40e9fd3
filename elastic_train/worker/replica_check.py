"""``--verify-every K``: the replicas' state compared, every K steps and before every
checkpoint (issue 41's replica fingerprints).

DDP keeps every rank's parameters and optimizer state bitwise equal after every step; a
rank whose state differs holds silent data corruption (a flipped bit in memory, a wrong
kernel result). Each rank fingerprints its state where it lives (integrity/fingerprint.py:
integer sums of the raw bits, no copy to the host), one all-gather brings every rank the
others', and the verdict is the same on every rank (integrity/verdict.py): with three
replicas or more the odd one is named by majority, with two both are suspects. A mismatch
is said in one line, an event and a metric, and raises ``ReplicaDivergenceError`` on every
rank: the step's state is not checkpointed, and the job restarts from its newest
checkpoint, which was verified at its step (no checkpoint of a corrupt state is written).

Sharded models (fsdp, hsdp) hold no full replicas: not checked yet (said once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from elastic_train.checkpoint import sharded
from elastic_train.checkpoint.snapshot import Stateful
from elastic_train.errors import ReplicaDivergenceError
from elastic_train.events.log import EventLog
from elastic_train.events.schema import ReplicasDiverged
from elastic_train.integrity.fingerprint import state_fingerprint
from elastic_train.integrity.verdict import compare
from elastic_train.worker.distributed import Group, HostNames, gather_rows

__all__ = ["ReplicaCheck"]

log = logging.getLogger(__name__)

CERTIFIED = "replicas_verified"
"""The manifest field of a checkpoint whose replicas were compared equal at its step
(``elastic-train checkpoints list``: CERTIFIED)."""


class ReplicaCheck:
    """One worker's part of ``--verify-every`` (``every`` 0: off)."""

    def __init__(self, every: int, events: EventLog, sharded: bool = False,
                 certify: dict[str, Any] | None = None) -> None:
        self.every = every
        self.events = events
        if certify is not None:  # the checkpoints' metadata: each one compared at its step
            certify[CERTIFIED] = every > 0 and not sharded
        self.checked = 0
        """Checks this worker took part in (each one all-gather)."""
        self._hosts = HostNames()
        self._said_sharded = False

    def due(self, step: int, saving: bool = False) -> bool:
        """Whether ``step`` is checked: every ``every`` steps, and before a checkpoint."""
        return self.every > 0 and (saving or step % self.every == 0)

    def check(self, group: Group, step: int, objects: Mapping[str, Stateful]) -> None:
        """Every rank: compare the replicas' state after ``step`` (a collective); raises
        ``ReplicaDivergenceError`` on every rank when they differ."""
        model = objects["model"]
        if sharded.is_sharded(model):
            if not self._said_sharded and group.rank == 0:
                log.warning("--verify-every: a sharded model's ranks hold no full replicas; "
                            "its state is not compared yet")
            self._said_sharded = True
            return
        parts = [("model", model.state_dict())]
        if "optimizer" in objects:
            parts.append(("optimizer", objects["optimizer"].state_dict()))
        words = state_fingerprint(parts, group.device).reshape(-1)
        rows = gather_rows(group, words)
        self.checked += 1
        verdict = compare({rank: row.tolist() for rank, row in enumerate(rows)})
        if verdict.agree:
            return
        hosts = self._hosts.of(group)
        self.events.emit(ReplicasDiverged(step=step, named=list(verdict.named),
                                          suspects=list(verdict.suspects),
                                          nodes=[hosts[r] for r in verdict.suspects],
                                          replicas=group.world_size))
        raise ReplicaDivergenceError(step, verdict.describe(),
                                     sorted({hosts[r] for r in verdict.suspects}))
