"""The ``etcd-v3`` rendezvous, designed for etcd: one key per node on its lease, watches, one
transaction to close a round (``design=leases``, the default).

torch's dynamic rendezvous keeps the whole rendezvous in one value that every join and
every heartbeat rewrites by compare-and-swap: N nodes cost O(N²) attempts, and a dead node
is noticed after its heartbeats are judged stale. Here (keys: rounds.py):

- joining round r is one write: ``round/r/node/<node>`` on the node's lease (node_lease.py);
- the first node to create ``round/r/ctl/coordinator`` (one txn) closes the round: it
  reads the round's node keys once, watches them, and when torch's rule says so (``max``
  nodes, or ``min`` nodes for ``last_call`` seconds) writes ``round/r/ctl/world`` (the
  members in rank order) and ``latest`` in one transaction that only the first close can
  win. Every other node watches ``round/r/ctl/`` only: O(1) events per node, and a new
  coordinator when the old one's lease expires;
- a node that joined too late for round r finds itself missing from the world and joins
  round r + 1; the first to do so creates its coordinator key, which the members watch
  (``num_nodes_waiting``): a few events per member, not one per joining node;
- a member whose lease expires (its agent died, or was cut off for ``lease_ttl``) vanishes
  from ``round/r/node/``: every other member's watch sees the delete and reports a waiting
  node, so the agents re-form the world without it; a node whose own lease is gone rejoins
  (the members' watches: member_watch.py).

Requests per node per rendezvous: O(1), about 5 (read ``closed`` and ``latest``, one txn
that writes the node key and claims or reads the coordinator key, one watch, the store's
address); the coordinator also reads the round once (docs/rendezvous-at-scale.md).

For live recovery: ``next_rendezvous`` touches etcd and this node's lease only, never the
workers (they train on while the next round forms); ``world`` is the round's members in
rank order; ``leave`` drops this node without closing the rendezvous.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TypeVar

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from elastic_train.errors import RoundMemberLostError
from elastic_train.live.environment import set_rendezvous_seconds
from elastic_train.live.round_waits import mark_lost, marked_lost, wait_for_keys, waited
from elastic_train.rendezvous.etcd_v3.kv import (
    KV,
    EtcdUnreachableError,
    KeyValue,
    LeaseNotFound,
    WatchCompacted,
)
from elastic_train.rendezvous.etcd_v3.member_watch import MemberWatch
from elastic_train.rendezvous.etcd_v3.node_lease import NodeLease
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.etcd_v3.outage import Outage, retry_unreachable
from elastic_train.rendezvous.etcd_v3.rounds import RoundKeys, RoundTally, World
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease
from elastic_train.rendezvous.etcd_v3.state_backend import BACKEND_NAME
from elastic_train.rendezvous.etcd_v3.store import EtcdStore

log = logging.getLogger(__name__)

_POLL = 1.0  # seconds a wait blocks on a watch before it checks its deadline again

T = TypeVar("T")


STORE_INFO_SECONDS = 10.0
"""How long a member waits for the address rank 0 writes as it learns the world (the same
bound as agent/round_ranks.py's for the worker ranks that follow)."""
STORE_INFO_GIVEN_UP_KEY = "elastic_train/store_info_given_up"
"""Written in the round's store by the first member that gives up on rank 0's address
(live/round_waits.mark_lost): every other member's wait ends on it."""


def new_node_id(local_addr: str | None) -> str:
    """This agent's name in the rendezvous: host, pid and a random part (unique per run)."""
    host = (local_addr or socket.getfqdn()).replace("/", "_")
    return f"{host}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


class LeaseRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on per-node keys, leases and watches (module doc)."""

    def __init__(self, kv: KV, options: EtcdV3Options, run_id: str, min_nodes: int,
                 max_nodes: int, local_addr: str | None = None) -> None:
        if not run_id:
            raise ValueError("the rendezvous run id must be a non-empty string: pass --rdzv-id")
        self._kv = kv
        self._options = options
        self._run_id = run_id
        self._min_nodes = min_nodes
        self._max_nodes = max_nodes
        self._local_addr = local_addr
        self.node = new_node_id(local_addr)
        self.keys = RoundKeys.of(options.key_prefix, run_id)
        self._lease = NodeLease(kv, options.lease_ttl)
        self._job_lease = SharedLease(kv, options.state_ttl)
        self._store = EtcdStore(kv, self.keys.store, self._job_lease,
                                timedelta(seconds=options.read_timeout),
                                retry_seconds=options.connect_timeout)
        self._outage = Outage(kv.endpoint, options.lease_ttl)
        self.world: World | None = None
        self._last_world: World | None = None  # the one a join in progress re-forms
        self._watch = MemberWatch(kv, self.keys, self.node)  # a member's: who died, who waits
        self.lost_grace = 0.0
        """Seconds a member's expired lease waits before it makes the world re-form by a
        new round: live recovery sets it above its failure detector's timeout, which leaves
        the member out in place first (the fault campaign, seed 300: 6 s, not 1.5 s)."""
        self._member_key: str | None = None  # our node key in the round we are a member of
        self._joining: int | None = None  # the round a join in progress is in
        self._deadline: float | None = None  # of the join in progress
        self._closed = False
        try:  # like etcd's concurrency.Session: the agent's lease lives from its start
            self._lease.ensure()
        except EtcdUnreachableError:
            pass  # the join grants it, waiting for etcd up to connect_timeout

    # ---- torch's contract ------------------------------------------------------------------
    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # workers form their group on rank 0's own TCPStore (MASTER_ADDR/PORT)

    def next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        self._joining = self._deadline = None
        world = retry_unreachable(self._join, self._options.connect_timeout)
        set_rendezvous_seconds(time.monotonic() - started)
        rank = world.members.index(self.node)
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{world.round}", self._store)
        info = self._store_info(rank, store, world)
        log.info("node %s joined round %d of rendezvous %s as rank %d of %d", self.node,
                 world.round, self._run_id, rank, len(world.members))
        return RendezvousInfo(store, rank, len(world.members), info)

    def _store_info(self, rank: int, store: PrefixStore, world: World
                    ) -> RendezvousStoreInfo:
        """Where rank 0's workers host the process group's store: rank 0 picks a free port
        and writes both keys in one request, the others read both in one (torch's
        ``RendezvousStoreInfo.build`` does two of each). A rank 0 lost right after the round
        closed never writes them: ``RoundMemberLostError`` after ``STORE_INFO_SECONDS``, and
        the agent goes into the next round (agent/round_ranks.py; the fault campaign,
        etcd-v3 seed 512: the others waited the store's 60 s and ended). The wait ends at
        once, naming rank 0, when this node left rank 0 out (its failure detector:
        ``forget_nodes``) or another member gave up on it (its word in the round's store,
        for a member whose detector does not watch rank 0, as a node that joins): the soak
        of 5a44943, seed 1404, a one-way loss on rank 0 as the round closed held every step
        13.4 s, the 10 s of this wait and then the next round's wait for its lease."""
        keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        if rank == 0:
            addr, port = self._local_addr or socket.getfqdn(), get_free_port()
            store.multi_set(keys, [addr.encode(), str(port).encode()])
            return RendezvousStoreInfo(addr, port)
        began = time.monotonic()

        def given_up(_: list[str]) -> bool:
            return world.members[0] in self._watch.forgotten \
                or marked_lost(store, STORE_INFO_GIVEN_UP_KEY) is not None

        # rank 0 writes them as it learns the world: missing, it was lost just then
        if wait_for_keys(store, keys, began + STORE_INFO_SECONDS, given_up):
            if not given_up(keys):
                raise RoundMemberLostError([], len(world.members), STORE_INFO_SECONDS)
            mark_lost(store, STORE_INFO_GIVEN_UP_KEY, [0])
            raise RoundMemberLostError([0], len(world.members),
                                       waited(began, STORE_INFO_SECONDS),
                                       task="write where the workers meet")
        addr_bytes, port_bytes = store.multi_get(keys)
        return RendezvousStoreInfo(addr_bytes.decode(), int(port_bytes.decode()))

    def is_closed(self) -> bool:
        if self._closed:
            return True
        try:
            self._closed = self._kv.get(self.keys.closed) is not None
        except EtcdUnreachableError as exc:
            self._outage.failed(exc)
            return False
        return self._closed

    def set_closed(self) -> None:
        self._kv.put(self.keys.closed, b"1", self._job_lease.current())
        self._closed = True

    def rendezvous_node_id(self) -> str:
        """This agent's node in the rendezvous (rendezvous/forget.py)."""
        return self.node

    def round_node_ids(self, group_ranks: Collection[int]) -> list[str]:
        """The nodes of ``group_ranks`` in the round this node last joined (rank order)."""
        members = self.world.members if self.world is not None else ()
        return [members[r] for r in group_ranks if 0 <= r < len(members)]

    def forget_nodes(self, nodes: set[str], stalled: bool = False) -> list[str]:
        """The world goes on without ``nodes`` (rendezvous/forget.py): their keys in the
        round are deleted (in the background: never wait for etcd), so that the next round,
        which waits for this one's live members (rounds.py), does not wait for their leases;
        their leases expiring later is no news. During this node's join, or when
        ``stalled`` (the world's workers wait for them), the round joined now or next
        closes without its last call (docs/several-nodes.md, seeds 801 and 810)."""
        world = self.world if self.world is not None else self._last_world
        members = set(world.members) if world is not None else set()
        found = sorted((nodes & members) - {self.node})
        self._watch.forget(found)
        if found and world is not None:  # mark stalled: the round being joined, or the next
            mark = self._joining if self.world is None else world.round + 1 if stalled else None
            keys = [self.keys.node(world.round, node) for node in found]
            threading.Thread(target=self._delete_quietly, args=(keys, mark), daemon=True,
                             name="etcd-v3-forget").start()
        return found

    def _delete_quietly(self, keys: list[str], joining: int | None) -> None:
        """Delete ``keys``; mark round ``joining`` (if any) stalled (rounds.py)."""
        try:
            for key in keys:
                self._kv.delete(key)
            if joining is not None:
                self._kv.put(self.keys.stalled(joining), b"1", self._job_lease.current())
        except Exception as exc:  # etcd away: the lease's expiry removes them later
            log.debug("could not leave %s out: %s", keys, exc)

    def num_nodes_waiting(self) -> int:
        """Whether the world must re-form, as torch's agent reads it (> 0): 1 when a node
        waits for the next round, plus 1 when a member's lease expired (not one live
        recovery already left out), or 1 when our own did. Reads the members' watches, not
        etcd."""
        if self.world is None:
            return 0
        if self._lease.lost:
            return 1
        try:
            self._watch.drain()
        except EtcdUnreachableError as exc:
            self._outage.failed(exc)
            self._watch.stop()
            return 0  # nobody can join while etcd is down: train on
        self._outage.reached()
        return (1 if self._watch.waiting else 0) + (1 if self._watch.lost_for(self.lost_grace)
                                                     else 0)

    def leave(self) -> None:
        """Leave without closing the rendezvous: stop watching and revoke this node's lease
        (its keys go at once, so the others see it leave at once)."""
        self._watch.stop()
        self._lease.revoke()

    def shutdown(self) -> bool:
        self._watch.stop()
        try:
            self.set_closed()
            return True
        except EtcdUnreachableError as exc:
            log.warning("could not mark rendezvous %s closed: %s", self._run_id, exc)
            return False
        finally:
            self._lease.revoke()

    # ---- joining ------------------------------------------------------------------------
    def _join(self) -> World:
        """One attempt at the next world (``retry_unreachable`` repeats it while etcd does not
        answer). A repeated attempt goes on with the round the failed one had joined, so a
        node whose round closed with it while etcd was away is not left alone in the next."""
        self._watch.stop()
        if self.world is not None:
            self._last_world = self.world
        self.world = None
        self._watch.forgotten.clear()
        found = self._kv.get_many([self.keys.closed, self.keys.latest])  # etcd must answer
        if self._closed or self.keys.closed in found:
            raise RendezvousClosedError(f"rendezvous {self._run_id} is closed: the job ended")
        if self._deadline is None:
            self._deadline = time.monotonic() + self._options.join_timeout
        if self._joining is None:
            latest = found.get(self.keys.latest)
            self._joining = int(latest.value) + 1 if latest is not None else 0
        while True:
            number = self._joining
            key = self.keys.node(number, self.node)
            world, revision = self._await_world(number, key, self._deadline)
            if self.node in world.members:
                break
            # Too late for this round (or beyond its maximum): the next one.
            self._kv.delete(key)
            self._joining = world.round + 1
        self._joining = self._deadline = None
        self.world = world
        previous, self._member_key = self._member_key, key
        try:
            if previous is not None and previous != key:
                self._kv.delete(previous)  # the round before: its members re-form too
            self._watch.start(world, revision + 1)
        except EtcdUnreachableError as exc:  # joined: num_nodes_waiting() watches again later
            self._outage.failed(exc)
            self._watch.stop()
            return world
        self._outage.reached()
        return world

    def _on_lease(self, write: Callable[[int], T], number: int, deadline: float) -> T:
        """``write(lease)`` with this node's lease; a fresh lease each time etcd says it
        forgot ours (we were cut off or frozen for longer than lease_ttl: our old keys are
        gone), until the join's deadline: not once only (docs/several-nodes.md, seed 726)."""
        while True:
            try:
                return write(self._lease.ensure())
            except LeaseNotFound:
                log.info("this node's etcd lease %x expired before its write to rendezvous "
                         "round %d: it takes a new one", self._lease.id, number)
                self._lease.forget()
                self._check_deadline(number, deadline)

    def _describe(self) -> bytes:
        return json.dumps({"addr": self._local_addr or socket.getfqdn(),
                           "pid": os.getpid()}).encode()

    def _await_world(self, number: int, key: str, deadline: float) -> tuple[World, int]:
        """Join round ``number`` as ``key``; its world and the revision it was written at:
        closed by us as its coordinator, or by another node."""
        coordinator, ctl = self.keys.coordinator(number), self.keys.ctl(number)
        while True:
            # One request: our node key, and the coordinator key if nobody holds it, else
            # the round's control keys as they are.
            claimed, kvs, revision = self._on_lease(lambda lease: self._kv.put_and_claim(
                key, self._describe(), coordinator, self.node.encode(), ctl, lease),
                number, deadline)
            found = self._coordinate(number, deadline) if claimed \
                else self._follow(number, deadline, kvs, revision)
            if found is not None:
                return found
            # The coordinator's lease expired before it closed the round: take over.

    def _follow(self, number: int, deadline: float, kvs: list[KeyValue] | None = None,
                revision: int = 0) -> tuple[World, int] | None:
        """Wait for round ``number``'s world, from its control keys ``kvs`` as of
        ``revision`` (read here when not given); None when its coordinator vanished first."""
        ctl = self.keys.ctl(number)
        world_key, coordinator_key = self.keys.world(number), self.keys.coordinator(number)
        if kvs is None:
            kvs, revision = self._kv.range_prefix(ctl)
        present = {kv.key: kv for kv in kvs}
        if world_key in present:
            found = present[world_key]
            return World.decode(found.value, world_key), found.mod_revision
        if coordinator_key not in present:
            return None
        if present[coordinator_key].value == self.node.encode():
            # Ours: an earlier attempt of this join created it, and its answer was lost.
            return self._coordinate(number, deadline)
        watch = self._kv.watch_prefix(ctl, revision + 1)
        try:
            while True:
                self._check_deadline(number, deadline)
                for event in watch.next(_POLL):
                    if event.key == world_key and event.kind == "put":
                        return World.decode(event.value, world_key), event.mod_revision
                    if event.key == coordinator_key and event.kind == "delete":
                        return None
        except WatchCompacted:
            return self._follow(number, deadline)
        finally:
            watch.cancel()

    def _coordinate(self, number: int, deadline: float) -> tuple[World, int]:
        """As round ``number``'s coordinator: close it when torch's rule says so."""
        tally = RoundTally(self._min_nodes, self._max_nodes, self._options.last_call_timeout)
        previous: tuple[str, ...] = ()
        stalled = self.keys.stalled(number)
        nodes, old = self.keys.nodes(number), self.keys.nodes(max(0, number - 1))
        # The watch starts after this first read's revision: what a later read misses, the
        # watch sees. (The stalled mark read first went unseen when forget_nodes put it
        # between the two reads: the round waited its last call; test_lease_rendezvous.py.)
        kvs, revision = self._kv.range_prefix(nodes)
        found = self._kv.get_many([self.keys.world(max(0, number - 1)), stalled])
        before = found.get(self.keys.world(number - 1)) if number > 0 else None
        if before is not None:
            previous = World.decode(before.value, self.keys.world(number - 1)).members
        if stalled in found:
            tally.stall()
        now = time.monotonic()
        for kv in kvs:
            tally.joined(kv.key[len(nodes):], kv.create_revision, now)
        if previous:  # its world runs while a member is alive: a second world must not
            old_kvs, old_revision = self._kv.range_prefix(old)
            tally.expect({kv.key[len(old):] for kv in old_kvs} & set(previous) - {self.node})
            revision = min(revision, old_revision)
        watch = self._kv.watch_prefix(self.keys.rounds, revision + 1)
        said = False
        try:
            while not tally.due(time.monotonic()):
                self._check_deadline(number, deadline)
                if not said and tally.awaited() and tally.due_but_for_the_previous_world(
                        time.monotonic()):
                    said = True
                    log.info("round %d of rendezvous %s waits for %s of round %d, alive: "
                             "its world runs, and they join this round when they see it",
                             number, self._run_id, ", ".join(sorted(tally.awaited())),
                             number - 1)
                wake = tally.wake_at()
                timeout = _POLL if wake is None else max(0.0, min(_POLL, wake - time.monotonic()))
                try:
                    events = watch.next(timeout)
                except WatchCompacted:
                    watch.cancel()
                    return self._coordinate(number, deadline)
                now = time.monotonic()
                for event in events:
                    if event.key.startswith(nodes):
                        node = event.key[len(nodes):]
                        if event.kind == "put":
                            tally.joined(node, event.create_revision, now)
                        else:
                            tally.left(node, now)
                    elif previous and event.key.startswith(old) and event.kind == "delete":
                        tally.previous_gone(event.key[len(old):])
                    elif event.key == stalled and event.kind == "put":
                        tally.stall()
        finally:
            watch.cancel()
        world = World(number, tally.close(previous))
        world_key = self.keys.world(number)
        self._kv.put_many_if_absent(
            world_key, [(world_key, world.encode()), (self.keys.latest, str(number).encode())],
            self._job_lease.current())
        # Ours, or (if a coordinator before us closed it and then died) that one's.
        written = self._kv.get(world_key)
        if written is None:
            raise RendezvousStateError(f"the rendezvous record {world_key} vanished right "
                                       "after it was written: is another program deleting "
                                       "the job's keys?")
        return World.decode(written.value, world_key), written.mod_revision

    def _check_deadline(self, number: int, deadline: float) -> None:
        if time.monotonic() >= deadline:
            raise RendezvousTimeoutError(
                f"rendezvous {self._run_id} round {number} did not complete within "
                f"{self._options.join_timeout:g} s (min {self._min_nodes} nodes): start the "
                "other nodes, or raise --rdzv-conf join_timeout")
