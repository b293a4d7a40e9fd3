"""Live recovery, the agent's side: re-form the world in place, on one node or across nodes.

torch's ``LocalElasticAgent`` starts a node's workers as one process context, and a
context whose process fails closes the rest; any failure or membership change then stops
every worker of every node and restarts them from the newest checkpoint.
``LiveRecoveryAgent`` starts each worker in a context of its own (``PerWorkerProcesses``)
and moves the world from one *generation* to the next instead (plans: live/plan.py):

- **After every rendezvous round** (the start, a node joining, torch's restart path) the
  agents of the round agree on the round's first plan: group rank 0 reads what each brings
  and commits the plan (the job's plan key, which it takes over; the round's store for
  the others to read). If some agent's workers hold the state, they
  keep running and every other worker starts without it and receives it from them
  (``live``); else every worker starts from the newest checkpoint (``fresh``). While the
  round forms, the workers train on: a node that joins costs them only the pause at a step
  boundary (torch's agent restarts every worker here).
- **When a worker dies**, its agent starts it again at once (a fork from the forkserver)
  and calls the other agents to re-form; **when a worker's collective fails** (a peer
  died, maybe with its whole node), its agent does the same. The calling agent
  coordinates: it tells every member of the generation before in that member's own store
  (live/peers.py: an agent that died refuses the connection, so it counts as lost at
  once, without waiting out a heartbeat, a lease or a last call), takes those that arrive,
  and commits the next plan by compare-and-swap of the job's plan key (in the rendezvous'
  own store, across rounds): from the plan it replaces, so a stale or partitioned
  coordinator cannot commit (also when the others formed a new round without it), and
  of two coordinators calling at once the one with the smaller id leads.
- **Telling the workers**: each agent writes the plan into its own store with a mode
  (``abort``: fail your collectives and re-form now; ``boundary``: re-form after your
  step once the new workers are built; ``start``) and bumps the generation its workers
  watch (worker/live_world.py).

It falls back to torch's restart path, unchanged, when live recovery cannot help: no worker
holds the state anymore, the world had not restored its state yet or had left the training
loop, the others re-formed the world without this node, the job asked for
``--recovery restart``, or the job spans nodes on a backend other than c10d or etcd-v3.
Restarts of failed workers in place are bounded by ``--max-restarts`` like group restarts,
so a worker that fails again and again ends in the restart path, then the job's failure.

Where the parts are: this module holds torch's hooks (through agent/torch_seams.py's
``TorchAgent``) and the translation between plans and torch's worker group; who decides a
plan and how the agents agree on it is live/coordination.py (torch-free, its races tested
over in-memory stores); what a plan is, live/plan.py; the per-worker process contexts,
agent/worker_processes.py; the watch on a silent c10d store, agent/store_watch.py. The
options reach each agent as a ``LiveOptions`` through the factory that
``live_agent_installed`` gives torch's launcher.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerState,
)

from elastic_train.agent.exit_watch import ExitWatch
from elastic_train.agent.failure_detector import TIMEOUT as DETECTOR_TIMEOUT
from elastic_train.agent.failure_detector import Peer, PeerHeartbeats
from elastic_train.agent.live_options import C10D_JOIN_TIMEOUT, LiveOptions
from elastic_train.agent.store_binding import listening_store
from elastic_train.agent.store_watch import STORE_ANSWER_SECONDS, end_if_store_lost
from elastic_train.agent.torch_seams import (
    TorchAgent,
    agent_class_replaced,
    start_processes_replaced,
)
from elastic_train.agent.wake import Wakeup
from elastic_train.agent.worker_processes import (
    PerWorkerProcesses,
    live_worker_env,
    per_worker_start,
)
from elastic_train.config import RecoveryMode
from elastic_train.live.coordination import (
    FOLLOW_SECONDS,
    RESTART,
    Coordinator,
    Notice,
    Round,
    local_value,
    lost_members,
)
from elastic_train.live.environment import LIVE_GENERATION
from elastic_train.live.messages import (
    FAILED_COLLECTIVE_KEY,
    FINISHED_KEY,
    GENERATION_KEY,
    READY_KEY,
    RESTARTING_KEY,
    Announcement,
    announcement_key,
    store_prefix,
)
from elastic_train.live.peers import PeerStores, bounded
from elastic_train.live.plan import LIVE, Arrival, Plan
from elastic_train.rendezvous.forget import forget_nodes, rendezvous_node_id

__all__ = ["LiveOptions", "LiveRecoveryAgent", "PerWorkerProcesses", "live_agent_installed",
           "live_worker_env"]

log = logging.getLogger(__name__)

ACROSS_NODES = ("c10d", "etcd-v3")
"""Rendezvous backends whose jobs re-form in place across nodes (tested with both)."""
class LiveRecoveryAgent(TorchAgent):
    """torch's local agent, with workers started again one by one and worlds re-formed in
    place across agents (see the module)."""

    def __init__(self, *args: Any, options: LiveOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options or LiveOptions()
        self._live_left = self.get_worker_group().spec.max_restarts
        self._node_store: dist.TCPStore | None = None
        self.address = ""
        """This agent's id in a plan: HOST:PORT of its store."""
        self._coordinator: Coordinator | None = None
        """This agent's side of the coordination (live/coordination.py), with its plan."""
        self._said_why_not = False
        self._round_agents = 1  # agents of the rendezvous round (torch's group world size)
        # torch's loop sleeps --monitor-interval before each check; here the check waits
        # for it instead, and a call or a worker's report (WAKE_KEY) ends the wait at once.
        spec = self.get_worker_group().spec
        self._interval, spec.monitor_interval = spec.monitor_interval, 0.0
        self._wake = Wakeup()
        self._exits = ExitWatch(self._wake.event)  # a worker's death wakes the loop too
        self._heartbeats: PeerHeartbeats | None = None
        """The failure detector (agent/failure_detector.py): a silent peer wakes the loop too."""
        self.beat = ""
        """Where this agent answers the failure detector's pings (HOST:PORT)."""
        self._store_check: threading.Thread | None = None
        self._loop_at = 0.0
        """When the monitor loop last ran (a thread tells from it whether the loop is stuck
        in torch's c10d handler)."""
        self._silenced: set[str] = set()
        """Peers the detector suspected since this agent adopted its plan, kept even if they
        answer again: the loop may have been blocked meanwhile (torch's c10d handler waits
        on a store that the cut-off side cannot reach), and a peer that fell silent may
        have re-formed the world without this node, whose workers then wait in a
        collective of the old one. A false suspicion costs a re-formation, no more."""

    @property
    def _plan(self) -> Plan | None:
        """The generation this agent applies (None: none, or torch's way)."""
        return self._coordinator.plan if self._coordinator is not None else None

    def _drop_plan(self) -> None:
        if self._coordinator is not None:
            self._coordinator.adopt(None)

    # ---- whether and where -----------------------------------------------------------------
    def _live_possible(self, worker_group: WorkerGroup) -> str | None:
        """None when this group's worlds can re-form in place, else why not."""
        if self.options.recovery != RecoveryMode.LIVE:
            return "--recovery restart"
        backend = worker_group.spec.rdzv_handler.get_backend()
        if (worker_group.group_world_size or 1) > 1 and backend not in ACROSS_NODES:
            return (f"live recovery across nodes needs --rdzv-backend c10d or etcd-v3 (this "
                    f"job uses {backend})")
        return None

    def _ensure_node_store(self, worker_group: WorkerGroup) -> None:
        if self._node_store is not None:
            return
        # for the agent's life; the workers' keys carry the restart count
        options: dict[str, Any] = {"wait_for_workers": False, "timeout": timedelta(seconds=60)}
        if self.options.listen_host is not None:  # where its clients are (agent/store_binding.py)
            self._node_store = listening_store(self.options.listen_host, 0, **options)
            host = self.options.listen_host
        else:
            self._node_store = dist.TCPStore(worker_group.master_addr or "127.0.0.1", 0,
                                             is_master=True, **options)
            host = worker_group.spec.local_addr or socket.getfqdn()
        self.address = f"{host}:{self._node_store.port}"
        c10d = worker_group.spec.rdzv_handler.get_backend() == "c10d"
        self._coordinator = Coordinator(
            self.address, self._node_store, PeerStores(timeout=FOLLOW_SECONDS),
            self.options.min_nodes,
            # c10d's store is a TCPStore in one agent: should that node fall silent (or
            # this one be cut off), torch's client would wait forever
            bounded=functools.partial(bounded, seconds=STORE_ANSWER_SECONDS) if c10d
            else lambda call: call())
        if self.options.peer_timeout > 0:
            self._heartbeats = PeerHeartbeats(self.options.listen_host or "0.0.0.0",
                                              on_suspect=self._on_silent,
                                              timeout=self.options.peer_timeout)
            self.beat = self._heartbeats.beat_address(host)
        # its own client, where the store listens (only on --local-addr across hosts)
        self._wake.watch(self._node_store, self.options.listen_host or "127.0.0.1")

    def _on_silent(self, agents: set[str]) -> None:
        """The failure detector's call (its thread): peers fell silent; the loop acts."""
        log.warning("no answer from the agent(s) %s for %.1f s (failure detector): the world "
                    "re-forms without them", ", ".join(sorted(agents)),
                    self._heartbeats.timeout if self._heartbeats else 0.0)
        self._silenced |= agents
        self._wake.set()
        checking = self._store_check is not None and self._store_check.is_alive()
        if self.get_worker_group().spec.rdzv_handler.get_backend() == "c10d" and not checking:
            self._store_check = threading.Thread(target=self._end_if_c10d_store_lost,
                                                 name="c10d-store-check", daemon=True)
            self._store_check.start()

    def _silent_members(self) -> set[str]:
        """Members of the current generation the failure detector suspects now."""
        if self._heartbeats is None or self._plan is None:
            return set()
        return (self._heartbeats.suspects() | self._silenced) & set(self._plan.agents)

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super().run(role)
        finally:
            self._exits.close()
            if self._heartbeats is not None:
                self._heartbeats.close()
            self._wake.close(self._node_store)

    def _store_of_workers(self, worker_group: WorkerGroup) -> dist.Store:
        """This agent's store, under the prefix its workers of this incarnation use
        (distributed.store_prefix)."""
        assert self._node_store is not None
        spec = worker_group.spec
        return dist.PrefixStore(store_prefix(spec.rdzv_handler.get_run_id(), self.restart_count),
                                self._node_store)

    def _job_store(self, worker_group: WorkerGroup) -> dist.Store:
        """Where the job's current plan is kept, across rendezvous rounds: the rendezvous'
        own store (c10d's TCPStore, etcd) under a key of the job, not of the round. Every
        plan is committed there by compare-and-swap from the plan it replaces, a round's
        first plan from whatever is there: so a coordinator whose world was superseded by
        a newer round (a node cut off while the others formed that round without it)
        commits nothing, although no one else ever wrote in its own round's store.

        On a backend whose worlds never re-form across nodes (torch's ``etcd``, whose
        store has no compare-and-swap), only a round of one agent re-forms in place: its
        plans stay in this agent's own store, where no other agent could commit one."""
        if worker_group.spec.rdzv_handler.get_backend() not in ACROSS_NODES:
            assert self._node_store is not None
            return dist.PrefixStore("elastic_train/job", self._node_store)
        store = worker_group.store
        if isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return dist.PrefixStore(f"elastic_train/{worker_group.spec.rdzv_handler.get_run_id()}",
                                store)

    # ---- starting: the first generation of a rendezvous round ------------------------------
    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        why_not = self._live_possible(worker_group)
        if why_not is not None:
            if self.options.recovery == RecoveryMode.LIVE and not self._said_why_not:
                log.warning("live recovery is off (%s): a failed worker restarts every "
                            "worker from the newest checkpoint", why_not)
                self._said_why_not = True
            if isinstance(self.process_context, PerWorkerProcesses):  # never two worlds at once
                self.process_context.close()
            self._drop_plan()
            return self._watched(self.torch_start_workers(worker_group))
        self._ensure_node_store(worker_group)
        self._round_agents = worker_group.group_world_size
        assert self._coordinator is not None
        round_ = Round(worker_group.store, worker_group.group_rank,
                       worker_group.group_world_size) if self._round_agents > 1 else None
        plan, raw = self._coordinator.agree_on_round(
            self._arrival(worker_group, self._holding()), round_, self._job_store(worker_group))
        if plan is None:  # a round with plain torchrun agents in it
            if isinstance(self.process_context, PerWorkerProcesses):
                self.process_context.close()
            self._drop_plan()
            return self._watched(self.torch_start_workers(worker_group))
        return self._apply_round(worker_group, plan, raw)

    def _apply_round(self, worker_group: WorkerGroup, plan: Plan, raw: bytes
                     ) -> dict[int, Any]:
        """Start the workers this agent must start for ``plan``; keep those that hold the
        state (they re-form at their next step boundary, or at once when peers were lost)."""
        before = self._plan
        keep = set(plan.keeps(self.address))
        workers = self.process_context
        workers = workers if isinstance(workers, PerWorkerProcesses) else None
        if not keep or workers is None:
            if workers is not None:
                if plan.kind == LIVE:  # others hold the state: these workers' is stale
                    workers.end_now()
                workers.close()
            self._adopt(worker_group, plan, raw)
            self._announce(worker_group, plan, "start")
            with self._per_worker_contexts(self.address, plan.generation):
                started = self.torch_start_workers(worker_group)
            log.info("generation %d (%s) of %d workers: started %d here (%s)", plan.generation,
                     plan.kind, plan.world_size, len(started), plan.cause)
            return started
        self._adopt(worker_group, plan, raw)
        if not plan.same_world(before):
            # Workers of the world before that do not go on: the others may wait on them.
            peers_lost = before is None or any(len(plan.keeps(m.agent)) < m.workers
                                               for m in before.members)
            self._announce(worker_group, plan, "abort" if peers_lost else "boundary")
            for local_rank in sorted(set(range(worker_group.spec.local_world_size)) - keep):
                workers.restart(local_rank, {LIVE_GENERATION: str(plan.generation)})
            log.warning("the world re-forms in place as generation %d: %d workers on %d "
                        "nodes (%s)", plan.generation, plan.world_size, len(plan.members),
                        plan.cause)
        return workers.pids()

    # ---- re-forming within a round ----------------------------------------------------------
    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._loop_at = time.monotonic()
        woken = self._wake.wait(self._interval)  # what woke it is read below (keys stay set)
        workers = self.process_context
        if not isinstance(workers, PerWorkerProcesses) or self._plan is None:
            result = self.torch_monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY:
                self._look_again_if_unreported(w.id for w in worker_group.workers)
            return result
        failed, _ = workers.poll_failed()
        store = self._store_of_workers(worker_group)
        # Calls and reports wake this loop; without store queues (torch < 2.6) look each time.
        look = woken or not self._wake.watching()
        notice = self._coordinator.notice() if look and self._coordinator else None
        reported = look and self._reported_failure(store)
        silent = self._silent_members()
        if not (failed or notice or reported or silent):
            if workers.wants_spare() and store.check([READY_KEY]) \
                    and not store.check([FINISHED_KEY]):
                workers.start_spare()
            self._look_again_if_unreported(workers.pids(running_only=True).values())
            with workers.as_polled():  # a failure the poll above missed waits for the next
                return self.torch_monitor_workers(worker_group)
        why_not = self._why_not_now(store, failed)
        if why_not is not None:
            log.warning("the world cannot re-form in place (%s): every worker of this node "
                        "restarts from the newest checkpoint", why_not)
            self._release_workers(worker_group)
            return self.torch_monitor_workers(worker_group) if failed \
                else RunResult(state=WorkerState.UNHEALTHY)
        if self._reform(worker_group, workers, failed, notice, silent):
            return RunResult(state=WorkerState.HEALTHY)
        return RunResult(state=WorkerState.UNHEALTHY, failures={
            worker_group.workers[lr].global_rank: failure for lr, failure in failed.items()})

    def _watched(self, pids: dict[int, Any]) -> dict[int, Any]:
        """``pids`` (torch's started workers), each watched for its end from now on."""
        for pid in pids.values():
            if isinstance(pid, int):
                self._exits.watch(pid)
        return pids

    def _look_again_if_unreported(self, pids: Iterable[Any]) -> None:
        """A watched worker ended but its process context does not report it yet (a
        forkserver reaps and reports its children a moment later): look again soon,
        not at the next --monitor-interval."""
        if self._exits.ended_among(pids):
            time.sleep(0.001)
            self._wake.set()

    def _why_not_now(self, store: dist.Store, failed: Mapping[int, Any]) -> str | None:
        if failed and self._live_left <= 0:
            return "the live restarts of --max-restarts are spent"
        if not store.check([READY_KEY]):
            return "the workers had not restored their state yet"
        if store.check([FINISHED_KEY]):
            return "the workers had left the training loop"
        return None

    def _reported_failure(self, store: dist.Store) -> bool:
        """A worker of this node saw a collective fail in the current generation."""
        assert self._plan is not None
        raw = local_value(store, FAILED_COLLECTIVE_KEY)
        return raw is not None and int(json.loads(raw)["generation"]) >= self._plan.generation

    def _reform(self, worker_group: WorkerGroup, workers: PerWorkerProcesses,
                failed: Mapping[int, Any], notice: Notice | None,
                silent: set[str] | frozenset[str] = frozenset()) -> bool:
        """Re-form the world without what was lost (``silent``: members the failure
        detector suspects, neither called nor waited for); False: this node must take
        torch's restart path (no one holds the state, or the others went on without it)."""
        coordination = self._coordinator
        assert coordination is not None and coordination.plan is not None
        detected_at = time.time()
        base = coordination.plan
        coordinator, generation = coordination.target(notice, silent)
        alive = tuple(sorted(workers.running()))
        if failed:  # forked now: they build while the world agrees
            self._live_left -= 1
            for local_rank in failed:
                pid = workers.restart(local_rank, {LIVE_GENERATION: str(generation)})
                worker_group.workers[local_rank].id = pid
            ranks = sorted(worker_group.workers[lr].global_rank for lr in failed)
            log.warning("worker rank(s) %s failed (exit code %s): started again into the "
                        "running world (live recovery, %d live restart(s) left)", ranks,
                        [f.exitcode for f in failed.values()], self._live_left)
        arrival = self._arrival(worker_group, alive)
        outcome = coordination.reform(self._job_store(worker_group), coordinator, generation,
                                      arrival, detected_at, silent)
        if outcome == RESTART:  # no member holds the state
            self._release_workers(worker_group)
            return False
        plan, raw = outcome if isinstance(outcome, tuple) else (None, None)
        if plan is None or raw is None or self.address not in plan.agents:
            log.warning("the others re-formed the world without this node: it ends its "
                        "workers (their state is superseded) and joins again")
            self._release_workers(worker_group)
            workers.end_now()
            return False
        self._adopt(worker_group, plan, raw)
        self._announce(worker_group, plan, "abort")
        log.warning("the world re-formed in place as generation %d: %d workers on %d nodes "
                    "(%s)", plan.generation, plan.world_size, len(plan.members), plan.cause)
        if plan.lost and plan.group_store == self.address:  # its coordinator, once told
            forget_nodes(worker_group.spec.rdzv_handler, lost_members(plan, base))
        return True

    def _end_if_c10d_store_lost(self) -> None:
        """(A thread, when a peer fell silent on c10d: agent/store_watch.py.)"""
        workers = self.process_context
        end_if_store_lost(self._job_store(self.get_worker_group()), lambda: self._loop_at,
                          workers if isinstance(workers, PerWorkerProcesses) else None,
                          self.options.store_lost_seconds,
                          self.get_worker_group().spec.rdzv_handler.get_run_id())

    # ---- telling the workers ----------------------------------------------------------------
    def _adopt(self, worker_group: WorkerGroup, plan: Plan, raw: bytes) -> None:
        """Take ``plan`` as this agent's generation: torch's view of the workers follows."""
        assert self._coordinator is not None
        self._coordinator.adopt(plan, raw)
        self._silenced = set()
        if self._heartbeats is not None:
            self._heartbeats.watch(self.address, [Peer(m.agent, m.beat) for m in plan.members])
        ranks = plan.ranks(self.address)
        for worker in worker_group.workers:
            worker.global_rank = worker.role_rank = ranks[worker.local_rank]
            worker.world_size = worker.role_world_size = plan.world_size
        worker_group.group_rank = plan.node_index(self.address)
        worker_group.group_world_size = len(plan.members)

    def _release_workers(self, worker_group: WorkerGroup) -> None:
        """Tell this node's workers that no new generation comes (``RESTARTING_KEY``): one
        waiting for it after a failed step fails at once, instead of at its timeout while
        torch's agent waits for it to stop."""
        with contextlib.suppress(RuntimeError, OSError):
            self._store_of_workers(worker_group).set(RESTARTING_KEY, "1")

    def _announce(self, worker_group: WorkerGroup, plan: Plan, mode: str) -> None:
        """Tell this node's workers about ``plan``: ``abort`` (fail your collectives and
        re-form now), ``boundary`` (re-form at the end of your step, once the workers that
        start are ready) or ``start`` (for workers that start into it)."""
        store = self._store_of_workers(worker_group)
        store.set(announcement_key(plan.generation),
                  Announcement(mode, self.address, plan).encode())
        store.set(GENERATION_KEY, str(plan.generation))

    def _arrival(self, worker_group: WorkerGroup, alive: tuple[int, ...]) -> Arrival:
        plan = self._plan
        node = rendezvous_node_id(worker_group.spec.rdzv_handler)
        if plan is None or self.address not in plan.agents:
            return Arrival(self.address, worker_group.spec.local_world_size, rdzv_node=node,
                           beat=self.beat)
        first = plan.first_rank(self.address)
        return Arrival(self.address, worker_group.spec.local_world_size, alive, first,
                       plan.generation, plan.world_size, writer=first == 0 and 0 in alive,
                       rdzv_node=node, beat=self.beat)

    def _holding(self) -> tuple[int, ...]:
        """Local ranks whose workers hold the state now (run, restored, in the loop)."""
        workers = self.process_context
        if not isinstance(workers, PerWorkerProcesses) or self._plan is None:
            return ()
        workers.poll_failed()
        store = self._store_of_workers(self.get_worker_group())
        if not store.check([READY_KEY]) or store.check([FINISHED_KEY]):
            return ()
        return tuple(sorted(workers.running()))

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        """A node waits to join (torch's agent calls this on a healthy group): a new
        rendezvous round while the workers train on, then a plan that keeps them. On a
        backend whose worlds do not re-form across nodes the round will have two nodes and
        no live recovery: the workers stop first, as torch's agent stops them."""
        if worker_group.state == WorkerState.HEALTHY and self._holding() \
                and self._live_possible(worker_group) is None \
                and worker_group.spec.rdzv_handler.get_backend() in ACROSS_NODES:
            self.rendezvous(worker_group)
            for local_rank, pid in self.start_workers(worker_group).items():
                worker_group.workers[local_rank].id = pid
            worker_group.state = WorkerState.HEALTHY
            return
        self.torch_restart_workers(worker_group)

    @contextlib.contextmanager
    def _per_worker_contexts(self, live_store: str, generation: int) -> Iterator[None]:
        """While the base class starts the workers: one context per worker, the workers
        told that the agent restarts them one by one."""
        make = per_worker_start(live_store, generation, self._exits.watch,
                                self._node_store if self.options.hot_spare else None)
        with start_processes_replaced(make):
            yield


@contextlib.contextmanager
def live_agent_installed(recovery: str, listen_host: str | None = None,
                         hot_spare: bool = False, peer_timeout: float = DETECTOR_TIMEOUT,
                         store_lost_seconds: float = C10D_JOIN_TIMEOUT, min_nodes: int = 1
                         ) -> Iterator[None]:
    """Make torch's launcher run ``LiveRecoveryAgent`` (for ``elastic-train run``), each
    agent built with these options (no option lives on the class)."""
    options = LiveOptions(recovery, listen_host, hot_spare, peer_timeout, store_lost_seconds,
                          min_nodes)
    with agent_class_replaced(functools.partial(LiveRecoveryAgent, options=options)):
        yield
