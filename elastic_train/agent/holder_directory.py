"""How an agent's snapshot holder (agent/snapshot_holder.py) finds the other agents'.

After each rendezvous round every agent publishes its holder (url, token, host) in the
round's store under ``live.memory_tier.HOLDER_KEY`` with its group rank, and reads the
others' entries as they appear: ``refresh`` looks (``check``, never a blocking ``get``) for
the entries still missing, from the agent's own loop, until every agent of the round is
known or ``LOOK_SECONDS`` have passed. The round's store is what torch's agent gives the
round (``worker_group.store``: a prefix of the rendezvous' store per round), reachable by
every agent of the job on c10d, etcd-v3 and torch's etcd and static backends, so the list
of a round holds that round's agents only. An agent that died since is still listed: its
holder refuses the connection (or a gone host times out in 1 s), and the holder skips it
for a while. When the store cannot be used, the holder keeps its one copy and says so once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from elastic_train.agent.snapshot_holder import SnapshotHolder
from elastic_train.live.memory_tier import HOLDER_KEY, HolderEntry

__all__ = ["HolderDirectory"]

log = logging.getLogger(__name__)

LOOK_SECONDS = 60.0
"""How long after a round's start the others' entries are looked for."""


class RoundStore(Protocol):
    def set(self, key: str, value: Any) -> None: ...
    def get(self, key: str) -> Any: ...
    def check(self, keys: list[str]) -> bool: ...


class HolderDirectory:
    """This agent's holder's entry in each round's store, and the others' read back into
    the holder (``SnapshotHolder.set_peers``)."""

    def __init__(self, holder: SnapshotHolder) -> None:
        self.holder = holder
        self._store: RoundStore | None = None
        self._found: dict[int, HolderEntry] = {}
        self._missing: list[int] = []
        self._until = 0.0
        self._said = False

    def publish(self, store: RoundStore, rank: int, world_size: int) -> None:
        """At the start of a round (group rank ``rank`` of ``world_size`` agents)."""
        self._store, self._found = store, {}
        self._missing = [r for r in range(world_size) if r != rank]
        self._until = time.monotonic() + LOOK_SECONDS
        entry = self.holder.entry(rank)
        self._found[rank] = entry
        try:
            store.set(HOLDER_KEY.format(rank=rank), entry.to_json())
        except Exception as exc:  # a store that cannot take it: one copy, said once
            self._give_up(exc)
            return
        self.holder.set_peers(list(self._found.values()))
        self.refresh()

    def refresh(self) -> None:
        """Read the entries that appeared since (cheap: nothing when none is missing)."""
        if self._store is None or not self._missing:
            return
        if time.monotonic() > self._until:
            log.warning("memory tier: the holders of agent(s) of group rank %s never showed "
                        "in the rendezvous store: snapshots are copied to the others only",
                        self._missing)
            self._missing = []
            return
        try:
            for rank in list(self._missing):
                key = HOLDER_KEY.format(rank=rank)
                if self._store.check([key]):
                    self._found[rank] = HolderEntry.from_json(self._store.get(key))
                    self._missing.remove(rank)
                    self.holder.set_peers(list(self._found.values()))
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        self._missing, self._store = [], None
        if not self._said:
            log.warning("memory tier: the rendezvous store cannot list the agents' holders "
                        "(%s: %s): this node's holder keeps its one copy", type(exc).__name__,
                        exc)
            self._said = True
