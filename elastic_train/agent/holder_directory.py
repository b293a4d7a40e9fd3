"""How an agent's snapshot holder (agent/snapshot_holder.py) finds the other agents'.

After each rendezvous round every agent publishes its holder (url, token, host) in the
round's store under ``live.memory_tier.HOLDER_KEY`` with its group rank, and reads the
others' entries as they appear (``check``, never a blocking ``get``) until every agent of
the round is known or ``LOOK_SECONDS`` have passed. Both happen in a thread of the
directory's own, never in the agent's loop: on etcd-v3 the round's store is etcd, and a
look while etcd was down held the loop for the store's 10 s retry, and with it a node's
join into the live world (the fault campaign, etcd-v3 seed 582: an etcd kill cost 11 s).
The round's store is what torch's agent gives the round (``worker_group.store``: a prefix
of the rendezvous' store per round), reachable by every agent of the job on c10d, etcd-v3
and torch's etcd and static backends, so the list of a round holds that round's agents
only. An agent that died since is still listed: its holder refuses the connection (or a
gone host times out in 1 s), and the holder skips it for a while. When the store cannot be
used, the holder keeps its one copy and says so once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
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


LOOK_EVERY = 0.2
"""Seconds between two looks for the entries still missing."""


@dataclass
class _Round:
    store: RoundStore
    rank: int
    entry: HolderEntry
    missing: list[int]
    until: float
    found: dict[int, HolderEntry] = field(default_factory=dict)
    published: bool = False
    done: bool = False


class HolderDirectory:
    """This agent's holder's entry in each round's store, and the others' read back into
    the holder (``SnapshotHolder.set_peers``), by a thread that runs while a round has
    entries to write or to find."""

    def __init__(self, holder: SnapshotHolder, look_every: float = LOOK_EVERY) -> None:
        self.holder = holder
        self._look_every = look_every
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._said = False

    def publish(self, store: RoundStore, rank: int, world_size: int) -> None:
        """At the start of a round (group rank ``rank`` of ``world_size`` agents); returns
        at once: until the others are found, this holder keeps its copy alone."""
        entry = self.holder.entry(rank)
        self.holder.set_peers([entry])
        with self._lock:
            self._round = _Round(store, rank, entry,
                                 [r for r in range(world_size) if r != rank],
                                 time.monotonic() + LOOK_SECONDS, {rank: entry})
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="holder-directory",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def settled(self) -> bool:
        """Whether the current round's entries are all written and found, or given up."""
        with self._lock:
            return self._round is None or self._round.done

    def _run(self) -> None:
        while True:
            with self._lock:
                job = self._round
                if job is None or job.done:
                    self._thread = None
                    return
            self._wake.clear()
            self._step(job)
            if not job.done:
                self._wake.wait(self._look_every)

    def _step(self, job: _Round) -> None:
        """Write this agent's entry if not yet, then read the entries that appeared."""
        try:
            if not job.published:
                job.store.set(HOLDER_KEY.format(rank=job.rank), job.entry.to_json())
                job.published = True
            for rank in list(job.missing):
                key = HOLDER_KEY.format(rank=rank)
                if job.store.check([key]):
                    job.found[rank] = HolderEntry.from_json(job.store.get(key))
                    job.missing.remove(rank)
                    self._apply(job)
        except Exception as exc:  # a store that cannot take it or list it: one copy
            if not self._said:  # said before it is settled: who waits for that reads it
                log.warning("memory tier: the rendezvous store cannot list the agents' "
                            "holders (%s: %s): this node's holder keeps its one copy",
                            type(exc).__name__, exc)
                self._said = True
            job.done = True
            return
        if not job.missing:
            job.done = True
        elif time.monotonic() > job.until:
            log.warning("memory tier: the holders of agent(s) of group rank %s never showed "
                        "in the rendezvous store: snapshots are copied to the others only",
                        job.missing)
            job.done = True

    def _apply(self, job: _Round) -> None:
        """The peers found, unless a newer round replaced this one meanwhile."""
        with self._lock:
            if self._round is job:
                self.holder.set_peers(list(job.found.values()))
