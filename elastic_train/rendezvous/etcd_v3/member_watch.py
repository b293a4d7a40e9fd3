"""What a member of a closed round watches, so that ``num_nodes_waiting`` never asks etcd:
its peers' node keys (a member's lease expiring deletes its key) and the next round's
coordinator key (the first node waiting for that round creates it). A few events per
member, whatever the number of nodes.
"""

from __future__ import annotations

import logging
import time

from elastic_train.rendezvous.etcd_v3.kv import KV, Watch, WatchCompacted
from elastic_train.rendezvous.etcd_v3.rounds import RoundKeys, World

log = logging.getLogger(__name__)


class MemberWatch:
    """One member's watches on its world's round: who died, and whether a node waits."""

    def __init__(self, kv: KV, keys: RoundKeys, node: str) -> None:
        self._kv = kv
        self._keys = keys
        self._node = node
        self._world: World | None = None
        self._watches: list[Watch] = []
        self.waiting = False
        """A node waits for the next round (it created that round's coordinator key)."""
        self.lost: dict[str, float] = {}
        """Members whose lease expired, with the monotonic time it was seen."""
        self.forgotten: set[str] = set()
        """Members live recovery left out in place (``forget_nodes``): their expiry is no
        news."""

    def start(self, world: World, since: int) -> None:
        """Watch ``world``'s round from revision ``since`` (the world's close) on."""
        self._world = world
        self.waiting = False
        self.lost.clear()
        deaths = self._kv.watch_prefix(self._keys.nodes(world.round), since)
        try:
            arrivals = self._kv.watch_prefix(self._keys.ctl(world.round + 1), since)
        except BaseException:
            deaths.cancel()
            raise
        self._watches = [deaths, arrivals]

    def stop(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches = []

    def forget(self, nodes: list[str]) -> None:
        """``nodes`` are left out in place: neither lost now nor when their lease expires."""
        self.forgotten.update(nodes)
        for node in nodes:
            self.lost.pop(node, None)

    def lost_for(self, grace: float) -> bool:
        """Whether a member's lease has been gone for at least ``grace`` seconds."""
        now = time.monotonic()
        return any(now - since >= grace for since in self.lost.values())

    def drain(self) -> None:
        """Take in what the watches saw since the last call (never blocks); after a broken
        or compacted watch, read what etcd holds and watch again from there."""
        world = self._world
        assert world is not None, "drain() before start()"
        if not self._watches:  # broken by an outage: read again, watch again
            self._restart(world)
        deaths, arrivals = self._watches
        try:
            died, arrived = deaths.next(0.0), arrivals.next(0.0)
        except WatchCompacted:
            self._restart(world)
            return
        prefix, members = self._keys.nodes(world.round), set(world.members)
        for event in died:
            node = event.key[len(prefix):]
            if event.kind == "delete" and node in members and node != self._node \
                    and node not in self.forgotten:
                if node not in self.lost:
                    log.warning("node %s of rendezvous round %d is gone (its lease expired):"
                                " re-forming the world without it", node, world.round)
                self.lost.setdefault(node, time.monotonic())
        coordinator = self._keys.coordinator(world.round + 1)
        for event in arrived:
            if event.key == coordinator:
                self.waiting = event.kind == "put"

    def _restart(self, world: World) -> None:
        """What etcd holds now (one read each), then watch again from there."""
        self.stop()
        members, revision = self._kv.range_prefix(self._keys.nodes(world.round))
        waiting = self._kv.get(self._keys.coordinator(world.round + 1))
        alive = {kv.key[len(self._keys.nodes(world.round)):] for kv in members}
        self.start(world, revision + 1)
        self.waiting = waiting is not None
        for node in set(world.members) - alive - {self._node} - self.forgotten:
            self.lost.setdefault(node, time.monotonic())
