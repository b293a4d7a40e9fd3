"""Live recovery, the worker's side: a world that re-forms in place, on one node or several.

Each worker's agent (agent/live_agent.py) keeps a store for its workers (``env.live_store``; it
outlives every worker). Under ``store_prefix(run_id, restart)`` the agent
announces each *generation* of the world: the plan (live/plan.py: the members, this
worker's rank and world size, where the generation's process group forms, what was lost)
and a mode. Every worker of the world:

- watches the generation from a thread; a newer one in mode ``abort`` (a worker or a node
  was lost) fails its collectives at once (``aborts.abort_collectives``), so a
  survivor blocked on any peer leaves its step; one in mode ``boundary`` (a node joins)
  lets the step finish: once the workers that start into it are built, ``reform_due`` is
  set and the next vote takes every rank out of the loop at the same step;
- after a failed collective, tells its agent (``report_failed_collective``; a peer on
  another node may be gone, which only the agents can find out) and waits for the
  announcement (``announced``): a failure that no announcement explains is raised as
  before, so that the agent's restart path takes over;
- joins the generation (``join``): a barrier of all its workers in the generation's store
  (moved on to a newer generation if one is announced meanwhile: a member lost again),
  then a new process group there.

What the members do next, the state exchange, is the runtime's (runtime.WorkerRuntime.
share_state): the lowest rank holding the newest step sends the state to every member
behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic_train.config import RecoveryMode
from elastic_train.errors import LiveRecoveryError
from elastic_train.live.messages import (
    FAILED_COLLECTIVE_KEY,
    FINISHED_KEY,
    GENERATION_KEY,
    LEFT_KEY,
    READY_KEY,
    RESTARTING_KEY,
    Announcement,
    announcement_key,
    store_prefix,
)
from elastic_train.live.peers import bounded, split_address, wake
from elastic_train.live.plan import LIVE, Plan
from elastic_train.process_exit import left_in_c
from elastic_train.worker import aborts, distributed
from elastic_train.worker.distributed import Group
from elastic_train.worker.env import WorkerEnv

WATCH_INTERVAL = 0.05
"""Seconds between a worker's reads of the generation key."""
ANNOUNCE_TIMEOUT = 30.0
"""Seconds a worker whose step failed waits for its agent to announce a new generation:
more than a re-formation across nodes may take (live_agent.FOLLOW_SECONDS)."""
JOIN_CONNECT_SECONDS = 15.0
"""Bound on forming a re-formed world's process group: a member lost between the join's
barrier and the group costs this long, not the whole --collective-timeout."""


CONNECT_GRACE_SECONDS = 1.0
"""Past the client's own timeout, how long a connect is waited for before it is left."""


class Superseded(ConnectionError):
    """A newer generation was announced while this worker connected to a generation's
    store: it joins that one instead."""


@dataclass(frozen=True)
class LostMembers:
    """What a generation's plan says was lost."""

    ranks: list[int]
    detected_at: float | None
    cause: str | None = None
    lost_nodes: int = 0


def _store_client(address: str, timeout: timedelta) -> dist.Store:
    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


class LiveWorld:
    """This worker's membership in a world that re-forms in place (one per worker process).

    It starts in the generation its agent started it into (``env.live_generation``, read
    from the agent's store): ``arriving`` when that world already runs (the state comes
    from its members), else the world starts from the newest checkpoint. ``env`` is this
    worker's place in the newest generation it joined (rank, world, node).
    """

    def __init__(self, env: WorkerEnv, backend: str, timeout_seconds: float) -> None:
        assert env.live_store is not None
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        self._timeout = timedelta(seconds=timeout_seconds)
        self._prefix = store_prefix(env.run_id, env.restart_count)
        self._agent_store = _store_client(env.live_store, self._timeout)
        self._store = dist.PrefixStore(self._prefix, self._agent_store)
        self._watch_store = dist.PrefixStore(self._prefix, _store_client(env.live_store,
                                                                         self._timeout))
        self._base_env = env
        self.generation = env.live_generation
        announcement = self._announcement(max(self.latest(wait=True), self.generation))
        self._take(announcement)
        self.arriving = announcement.plan.kind == LIVE
        self._group_stores: dict[tuple[str, int, str], dist.Store] = {}
        self._group_stores_lock = threading.Lock()
        self._pending: Plan | None = None
        self._seen = self.generation
        self.reform_due = False
        """A boundary re-formation is ready: the next vote takes every rank out of the loop."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="live-recovery-watch",
                                        daemon=True)

    # ---- where this worker stands -----------------------------------------------------------
    def _take(self, announcement: Announcement) -> None:
        plan = announcement.plan
        rank = plan.ranks(announcement.agent)[self._base_env.local_rank]
        self.plan = plan
        self.generation = plan.generation
        self.env = dataclasses.replace(
            self._base_env, rank=rank, world_size=plan.world_size,
            group_rank=plan.node_index(announcement.agent), group_world_size=len(plan.members))

    def provisional_group(self) -> Group:
        """This worker's place before it joins (an arriving worker builds its model first)."""
        device = distributed.pick_device(self.env)
        return Group(self.env.rank, self.env.world_size,
                     distributed.pick_backend(self.backend, device), device)

    # ---- watching ---------------------------------------------------------------------------
    def start(self) -> LiveWorld:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def ready(self) -> None:
        """The world holds its state (see ``READY_KEY``)."""
        with contextlib.suppress(Exception):
            self._store.set(READY_KEY, "1")

    def finished(self) -> None:
        """This worker left the training loop (see ``FINISHED_KEY``)."""
        with contextlib.suppress(Exception):
            self._store.set(FINISHED_KEY, "1")

    def latest(self, wait: bool = False) -> int:
        """The newest generation the agent announced (``wait``: until there is one)."""
        if wait:
            self._store.wait([GENERATION_KEY])
        return int(self._store.add(GENERATION_KEY, 0))

    def _announcement(self, generation: int, store: dist.Store | None = None) -> Announcement:
        return Announcement.decode((store or self._store).get(announcement_key(generation)))

    def report_failed_collective(self, leaving: tuple[int, ...] = ()) -> None:
        """Tell the agent that a collective of this generation failed (a peer may be gone),
        or (``leaving``: their group ranks) that nodes leave at this step boundary: the
        agents re-form without them, neither calling them nor waiting for them."""
        with contextlib.suppress(Exception):
            self._store.set(FAILED_COLLECTIVE_KEY, json.dumps(
                {"generation": self.generation, "rank": self.env.rank, "time": time.time(),
                 "leaving": list(leaving)}))
            wake(self._agent_store)

    def left(self, step: int) -> None:
        """This node's workers leave the job alone at ``step`` (see ``LEFT_KEY``)."""
        with contextlib.suppress(Exception):
            self._store.set(LEFT_KEY, str(step))

    def report_leaving(self, nodes: tuple[int, ...]) -> None:
        """Nodes signalled alone leave at this step (runtime's vote): re-form without them."""
        self.report_failed_collective(leaving=nodes)

    def _watch(self) -> None:
        """The watcher thread: it reads only this worker's agent store (its own host), so
        that nothing a peer does can hold it; whether a boundary re-formation is ready is
        asked of the new generation's store by a thread of its own (``_watch_ready``)."""
        ready: tuple[Plan, threading.Thread] | None = None  # the plan it asks of, its thread
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                latest = int(self._watch_store.add(GENERATION_KEY, 0))
                if latest > max(self.generation, self._seen):
                    self._seen = latest
                    announcement = self._announcement(latest, self._watch_store)
                    if announcement.mode == "boundary":
                        self._pending = announcement.plan
                    else:
                        aborts.abort_collectives(
                            f"the world re-forms as generation {latest} "
                            f"({announcement.plan.cause})", latest)
                pending = self._pending
                if pending is not None and pending.generation > self.generation \
                        and not self.reform_due \
                        and (ready is None or ready[0] is not pending or not ready[1].is_alive()):
                    ready = (pending, threading.Thread(target=self._watch_ready, args=(pending,),
                                                       name="live-recovery-ready", daemon=True))
                    left_in_c(ready[1])
                    ready[1].start()
            except Exception:  # the agent's store is gone (the job is ending)
                if self._stop.is_set():
                    return

    def _watch_ready(self, pending: Plan) -> None:
        """Until every worker of boundary generation ``pending`` is ready (then
        ``reform_due``), or it is no longer the one pending. Its store is a peer's: should
        that host freeze or be cut off, torch's client waits without bound, and this thread
        with it, left behind; the watcher goes on reading the agent's announcements, and
        the newer generation that leaves that peer out aborts the collectives the loop
        waits in (the fault campaign, etcd-v3 seed 1009 of 4eb25d8's soak: a node frozen
        right after a boundary generation was announced, its store the generation's; the
        watcher, blocked on it, never saw the next generation, and the survivors waited
        12.4 s, to the thaw, where the agents had re-formed without it in 1.4 s)."""
        with contextlib.suppress(Exception):
            store = self._generation_store(pending, private=True)
            while not self._stop.is_set() and self._pending is pending and not self.reform_due:
                if int(store.add("ready", 0)) >= pending.started:
                    if self._pending is pending:
                        self.reform_due = True
                    return
                time.sleep(WATCH_INTERVAL)

    def announced(self, timeout: float | None = None) -> int | None:
        """After a failed step: the newer generation the agent announced, or None if none
        comes within ``timeout`` (default ``ANNOUNCE_TIMEOUT``; the failure was this
        worker's own)."""
        deadline = time.monotonic() + (ANNOUNCE_TIMEOUT if timeout is None else timeout)
        while True:
            with contextlib.suppress(Exception):
                latest = self.latest()
                if latest > self.generation:
                    return latest
                if self._store.check([RESTARTING_KEY]):
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    # ---- re-forming -------------------------------------------------------------------------
    def _generation_store(self, plan: Plan, private: bool = False) -> dist.Store:
        """The store generation ``plan`` forms in: its coordinator's, under its own prefix
        (``private``: a client of the watcher thread's own). A connection of its own per
        generation: one kept from an older generation may have lived through a network
        fault to that agent, and TCP's retransmission backoff then held every request on it
        for about 10 s after the fault healed (the fault campaign, etcd-v3 seeds 572 and 582:
        a node's join after its one-way loss cost 11-12 s, the survivors' ``add`` waiting)."""
        use = "watch" if private else "main"
        key = (plan.group_store, plan.generation, use)
        with self._group_stores_lock:
            client = self._group_stores.get(key)
        if client is None:  # each use is one thread's: connected outside the lock, so that
            # the watcher's connect never holds the main thread's
            client = self._connect(plan, self._watch_store if private else self._store)
            with self._group_stores_lock:
                for old in [k for k in self._group_stores if k[2] == use]:
                    del self._group_stores[old]  # closed once the last reference goes
                self._group_stores[key] = client
        return dist.PrefixStore(f"elastic_train/{self._base_env.run_id}/gen-{plan.generation}",
                                client)

    def _connect(self, plan: Plan, store: dist.Store) -> dist.Store:
        """A client of generation ``plan``'s store, given up (``Superseded``) as soon as the
        agent announces a newer generation on ``store``: torch's client constructor cannot
        be interrupted, and a connect to a host killed meanwhile, or silent, waits out its
        whole timeout (the fault campaign, etcd-v3 seed 815: a worker inside it for the
        store of a host killed as the world grew, 43 s to its next step, where the others
        re-formed without that host in 1.4 s). The constructor is left behind in a daemon
        thread (``live.peers.bounded``), which ends at its own timeout."""
        def superseded() -> bool:
            with contextlib.suppress(Exception):
                return int(store.add(GENERATION_KEY, 0)) > plan.generation
            return False

        try:
            return bounded(lambda: _store_client(plan.group_store,
                                                 timedelta(seconds=JOIN_CONNECT_SECONDS)),
                           JOIN_CONNECT_SECONDS + CONNECT_GRACE_SECONDS, gone=superseded)
        except ConnectionError as exc:
            if superseded():
                raise Superseded(f"generation {plan.generation} was superseded while this "
                                 f"worker connected to its store at {plan.group_store}"
                                 ) from exc
            raise

    def ready_to_join(self) -> None:
        """A worker that starts into a running world: built, it may now be waited for (the
        members of a boundary re-formation leave their loop only then)."""
        with contextlib.suppress(Exception):
            latest = max(self.latest(), self.generation)
            if latest != self.generation:
                self._take(self._announcement(latest))
            self._generation_store(self.plan).add("ready", 1)

    def join(self) -> Group:
        """Meet every member of the newest generation; form its process group.

        Raises ``LiveRecoveryError`` when the members are not all there within the group's
        timeout (the agent then restarts the job from its checkpoint).
        """
        deadline = time.monotonic() + self.timeout_seconds
        generation = max(self.latest(), self.generation)
        while True:
            self._take(self._announcement(generation))
            try:
                store = self._generation_store(self.plan)
            except Superseded:  # its store's host may be the member just lost
                generation = self.latest()
                continue
            world = self.plan.world_size
            store.add("joined", 1)
            while True:
                latest = self.latest()
                if latest > generation:  # a member was lost again: meet in the next one
                    generation = latest
                    break
                joined = int(store.add("joined", 0))
                if joined >= world:
                    self._pending, self.reform_due = None, False
                    return distributed.init_group(
                        self.env, self.backend, self.timeout_seconds, generation=generation,
                        connect_seconds=JOIN_CONNECT_SECONDS,
                        store=dist.PrefixStore("group", store),
                        store_address=f"{self.plan.group_store} (generation {generation})")
                if time.monotonic() >= deadline:
                    raise LiveRecoveryError(
                        f"the world did not re-form: {joined} of {world} workers came back "
                        f"within {self.timeout_seconds:g} s (--collective-timeout); the job "
                        "restarts from its newest checkpoint")
                time.sleep(0.005)

    def failure(self, generation: int) -> LostMembers:
        """What generation ``generation``'s plan says was lost."""
        try:
            plan = self._announcement(generation).plan
        except (RuntimeError, ValueError, KeyError):
            return LostMembers([], None)
        return LostMembers(list(plan.failed_ranks), plan.detected_at, plan.cause, len(plan.lost))


def live_needs_our_agent(silence: str) -> str:
    """What a job asking for live recovery under plain torchrun is told, once."""
    return ("live recovery needs elastic-train run (torchrun's agent restarts every worker "
            "on any failure): this job restarts from its newest checkpoint instead "
            f"({silence} says so and silences this line)")


def live_world_for(recovery: str, env: WorkerEnv, backend: str, timeout_seconds: float,
                   silence: str) -> LiveWorld | None:
    """This worker's part in live recovery, when the job asks for it (``recovery`` is
    ``live``) and its agent can; else None, and rank 0 of a plain torchrun job says why
    once (``silence``: how the job asks for the restart path)."""
    if recovery != RecoveryMode.LIVE or not env.under_torchrun:
        return None
    if not env.live_recovery or not env.live_store:
        if env.world_size > 1 and env.rank == 0 and env.restart_count == 0:
            print(f"elastic_train: {live_needs_our_agent(silence)}", file=sys.stderr,
                  flush=True)
        return None
    return LiveWorld(env, backend, timeout_seconds)
