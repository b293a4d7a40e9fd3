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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult

from elastic_train.agent.exit_watch import ExitWatch
from elastic_train.agent.failure_detector import TIMEOUT as DETECTOR_TIMEOUT
from elastic_train.agent.failure_detector import Peer, PeerHeartbeats
from elastic_train.agent.store_binding import listening_store
from elastic_train.agent.torch_seams import (
    TorchAgent,
    agent_class_replaced,
    start_processes_replaced,
    worker_logs_specs,
)
from elastic_train.agent.worker_start import stop_worker_server
from elastic_train.errors import RendezvousStoreLostError
from elastic_train.live.environment import LIVE_GENERATION, LIVE_RECOVERY, LIVE_STORE
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
from elastic_train.live.peers import (
    NOTICE_KEY,
    RESTART,
    WAKE_KEY,
    Notice,
    PeerStores,
    arrival_key,
    bounded,
    commit_plan,
    local_value,
    plan_key,
    take_over,
)
from elastic_train.live.plan import LIVE, Arrival, Plan, plan_reformation, plan_round
from elastic_train.live.spare import assign, spare_delay, spare_env
from elastic_train.process_exit import exit_now
from elastic_train.rendezvous.forget import forget_nodes, rendezvous_node_id

log = logging.getLogger(__name__)

ACROSS_NODES = ("c10d", "etcd-v3")
"""Rendezvous backends whose jobs re-form in place across nodes (tested with both)."""
ROUND_PREFIX = "elastic_train/live"
COMMITTED_KEY = f"{ROUND_PREFIX}/plan"
"""The newest committed plan: in the rendezvous' store under the job's prefix (across
rounds: ``_job_store``), and each round's first plan in the round's store too."""
ARRIVE_SECONDS = 10.0
"""How long a coordinator waits for a member that took its call to arrive (members look
for calls every --monitor-interval; one busy in a rendezvous round comes later)."""
FOLLOW_SECONDS = ARRIVE_SECONDS + 5.0
"""How long a member waits for its coordinator's plan before it coordinates itself."""
REFORM_ATTEMPTS = 3
STOCK_ROUND = b"stock"
"""The round's plan when some agent of it is not ours: every worker starts the torch way."""
WAKER_STOP = b"stop"
STORE_ANSWER_SECONDS = 5.0
"""How long a coordinator waits for c10d's store to take its plan before it takes that
store's node for lost (a healthy one answers in milliseconds)."""
C10D_JOIN_TIMEOUT = 600.0
"""torch's default ``join_timeout`` of the c10d rendezvous."""
UNCOMMITTED = b"uncommitted"
"""A coordinator's outcome when it could not reach the rendezvous' store to commit."""
SPARE_ENDS = 2
"""Spares that may end on their own before the agent stops making them."""
SPARE_DISMISS_SECONDS = 2.0
"""How long a dismissed spare may take to exit before it is killed."""
MIXED_ROUND_SECONDS = 5.0
"""How long group rank 0 waits for the other agents of a round to say what they bring
before it takes the round for one with plain torchrun agents in it."""

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LIVE_NCCL_ERROR_HANDLING = "2"
"""What live workers get unless the job set it: on an NCCL error, abort the communicator
and keep the process (torch's agent passes 1: abort and tear the process down, which would
end the survivors that live recovery keeps). A collective that hangs is the step
watchdog's to end (``--step-timeout``)."""


def store_lost(run_id: str, seconds: float) -> RendezvousStoreLostError:
    return RendezvousStoreLostError(
        f"the c10d rendezvous store of job {run_id} did not answer for {seconds:g} s "
        "(--rdzv-conf join_timeout): its node is lost or this node is cut off, and a c10d "
        "job cannot "
        "outlive its store's node; restart the job (it resumes from its newest checkpoint), "
        "or run it on --rdzv-backend etcd-v3, which survives the loss of any node")


class PerWorkerProcesses:
    """A node's workers, each in a process context of its own, so that one can fail and be
    started again while the others run. Offers what torch's agent uses of a ``PContext``.
    """

    def __init__(self, start_one: Callable[[int, dict[str, str]], PContext],
                 envs: dict[int, dict[str, str]], spare_store: dist.Store | None = None
                 ) -> None:
        self._start_one = start_one
        self._envs = envs
        self._running: dict[int, PContext] = {lr: start_one(lr, env) for lr, env in envs.items()}
        self._pids = {lr: ctx.pids()[0] for lr, ctx in self._running.items()}
        self._results: dict[int, RunProcsResult] = {}
        self._hold = False
        self._spare_store = spare_store
        """Where spares are given their place (live/spare.py); None: no spares."""
        self._spare: PContext | None = None
        self._spare_delay = spare_delay()
        self._spare_due = time.monotonic() + self._spare_delay
        self._spare_ends = 0

    def pids(self, running_only: bool = False) -> dict[int, int]:
        """Each worker's pid (the last one of a worker that ended, unless ``running_only``)."""
        if running_only:
            return {lr: pid for lr, pid in self._pids.items() if lr in self._running}
        return dict(self._pids)

    @contextlib.contextmanager
    def as_polled(self) -> Iterator[None]:
        """While torch's monitor looks: ``wait`` reports what the last ``poll_failed``
        found and polls nothing (a failure found there would take torch's restart path,
        which stops every worker, before live recovery saw it)."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False

    def running(self) -> list[int]:
        """The local ranks whose process runs (as of the last poll)."""
        return list(self._running)

    def poll_failed(self) -> tuple[dict[int, Any], int]:
        """Poll every running worker: (the newly failed ones' failures by local rank, how
        many still run)."""
        failed: dict[int, Any] = {}
        for lr, ctx in list(self._running.items()):
            result = ctx.wait(0)
            if result is None:
                continue
            del self._running[lr]
            self._results[lr] = result
            if result.is_failed():
                failure = next(iter(result.failures.values()))
                failure.local_rank = lr
                failed[lr] = failure
        return failed, len(self._running)

    def restart(self, local_rank: int, extra_env: dict[str, str]) -> int:
        """Start worker ``local_rank`` again (it failed): the spare takes its place if one
        runs, else a new process is forked; its new pid."""
        self._results.pop(local_rank, None)
        env = {**self._envs[local_rank], **extra_env}
        spare = self._take_spare()
        if spare is not None:
            assert self._spare_store is not None
            assign(self._spare_store, spare.pids()[0], env)
            self._running[local_rank] = spare
        else:
            self._running[local_rank] = self._start_one(local_rank, env)
        self._pids[local_rank] = self._running[local_rank].pids()[0]
        return self._pids[local_rank]

    def wants_spare(self) -> bool:
        """Whether a spare should be started now (none runs, and one is due)."""
        if self._spare_store is None:
            return False
        self._spare_ended()
        return self._spare is None and self._spare_ends < SPARE_ENDS \
            and time.monotonic() >= self._spare_due

    def start_spare(self) -> int:
        """Fork a spare now (``hot_spare``): the environment of the lowest local rank, marked
        as a spare. Its pid."""
        template = min(self._envs)
        self._spare = self._start_one(template, spare_env(self._envs[template]))
        return self._spare.pids()[0]

    def _take_spare(self) -> PContext | None:
        if self._spare_ended() or self._spare is None:
            return None
        spare, self._spare = self._spare, None
        self._spare_due = time.monotonic() + self._spare_delay
        return spare

    def _spare_ended(self) -> bool:
        """Whether the spare ended on its own (killed, or it could not build): then it is
        counted, said and forgotten, and the next one is due after the delay."""
        if self._spare is None or self._spare.wait(0) is None:
            return False
        self._spare = None
        self._spare_ends += 1
        self._spare_due = time.monotonic() + self._spare_delay
        log.warning("the hot spare ended before it was needed (%d of %d): %s",
                    self._spare_ends, SPARE_ENDS, "another is started later"
                    if self._spare_ends < SPARE_ENDS else "no more spares")
        return True

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """What a ``PContext`` returns: a failure as soon as one worker failed, every
        return value once all succeeded, else None."""
        deadline = time.monotonic() + (timeout if timeout >= 0 else float("inf"))
        while True:
            if not self._hold:
                self.poll_failed()
            failures = {lr: next(iter(r.failures.values()))
                        for lr, r in self._results.items() if r.is_failed()}
            if failures:
                return RunProcsResult(failures=failures)
            if not self._running:
                return RunProcsResult(return_values={
                    lr: r.return_values.get(0) for lr, r in self._results.items()})
            if time.monotonic() >= deadline:
                return None
            time.sleep(period)

    def end_now(self) -> None:
        """SIGKILL every worker (not the spare): a world that went on without them
        superseded their state, and they may wait in one of its collectives, where a
        SIGTERM would wait out the preemption budget. The restart path starts them anew."""
        for ctx in self._running.values():
            ctx.close(signal.SIGKILL, 5)

    def close(self, death_sig: Any = None, timeout: int = 30) -> None:
        """Stop the workers, then the spare. The workers first: a SIGTERM (a preemption)
        must reach them at once, and a second signal that interrupts this must not leave
        one running; a spare left behind exits once this agent's store is gone."""
        spare, self._spare = self._spare, None
        for ctx in self._running.values():
            ctx.close(death_sig, timeout)
        self._running.clear()
        if spare is not None:
            self._dismiss(spare)
            spare.close(death_sig, timeout)

    def _dismiss(self, spare: PContext) -> None:
        """Tell an idle spare to exit (an empty place), and give it a moment: killed, it
        would be logged by torch as a worker closed by a signal."""
        assert self._spare_store is not None
        try:
            assign(self._spare_store, spare.pids()[0], {})
        except (RuntimeError, OSError):
            return
        spare.wait(SPARE_DISMISS_SECONDS, period=0.01)


def live_worker_env(env: dict[str, str], live_store: str, generation: int = 0,
                    agent_env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A worker's environment under live recovery: torch's, plus our agent's store and the
    generation it starts into (its plan is there), plus NCCL's error handling that keeps
    survivors alive unless the job set its own."""
    nccl = {} if NCCL_ERROR_HANDLING in agent_env \
        else {NCCL_ERROR_HANDLING: LIVE_NCCL_ERROR_HANDLING}
    return {**env, LIVE_RECOVERY: "1", LIVE_STORE: live_store,
            LIVE_GENERATION: str(generation), **nccl}


@dataclass(frozen=True)
class LiveOptions:
    """What ``elastic-train run`` tells its agent (``live_agent_installed`` hands it to each
    agent torch's launcher builds)."""

    recovery: str = "live"
    """'live' or 'restart' (the job's --recovery)."""
    listen_host: str | None = None
    """The IP address the agent's store listens on (None: every interface;
    store_binding.node_store_host)."""
    hot_spare: bool = False
    """Keep a spare worker forked and built (live/spare.py; ``--hot-spare``, the built-in
    trainer only)."""
    peer_timeout: float = DETECTOR_TIMEOUT
    """Seconds a peer may be unheard before it is suspected (agent/failure_detector.py; 0: no
    detector; ``--peer-timeout``)."""
    store_lost_seconds: float = C10D_JOIN_TIMEOUT
    """How long a c10d node whose store went silent waits for it to answer again (a
    cut-off node whose cable comes back rejoins) before it ends with one line: the
    rendezvous' ``join_timeout``, as long as a node may wait to join."""
    min_nodes: int = 1
    """The job's minimum of nodes (``--nnodes MIN:MAX``): a world is never re-formed in
    place with fewer."""


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
        self._plan: Plan | None = None
        self._plan_raw = b""
        """The plan as committed (the rendezvous store swaps from these exact bytes)."""
        self._peers = PeerStores(timeout=FOLLOW_SECONDS)
        self._said_why_not = False
        self._noticed = -1  # the newest generation a peer's notice asked for, handled
        self._round_agents = 1  # agents of the rendezvous round (torch's group world size)
        # torch's loop sleeps --monitor-interval before each check; here the check waits
        # for it instead, and a call or a worker's report (WAKE_KEY) ends the wait at once.
        spec = self.get_worker_group().spec
        self._interval, spec.monitor_interval = spec.monitor_interval, 0.0
        self._wake = threading.Event()
        self._waker: threading.Thread | None = None
        self._exits = ExitWatch(self._wake)  # a worker's death wakes the loop at once too
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

    # ---- whether and where -----------------------------------------------------------------
    def _live_possible(self, worker_group: WorkerGroup) -> str | None:
        """None when this group's worlds can re-form in place, else why not."""
        if self.options.recovery != "live":
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
        if self.options.peer_timeout > 0:
            self._heartbeats = PeerHeartbeats(self.options.listen_host or "0.0.0.0",
                                              on_suspect=self._on_silent,
                                              timeout=self.options.peer_timeout)
            self.beat = self._heartbeats.beat_address(host)
        if hasattr(self._node_store, "queue_pop"):
            # its own client, where the store listens (only on --local-addr across hosts)
            self._waker = threading.Thread(target=self._wait_for_calls, args=(
                self.options.listen_host or "127.0.0.1", self._node_store.port),
                name="live-agent-wake", daemon=True)
            self._waker.start()

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

    def _wait_for_calls(self, host: str, port: int) -> None:
        """Wake the monitor loop whenever something is pushed to ``WAKE_KEY``. Should this
        thread end early (it cannot reach the store), the loop looks at every check."""
        try:
            client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(days=7))
        except (RuntimeError, OSError) as exc:
            log.warning("the agent cannot watch its own store at %s:%d (%s): it looks for "
                        "calls every --monitor-interval instead", host, port, exc)
            return
        while True:
            try:
                item = client.queue_pop(WAKE_KEY, block=True)
            except (RuntimeError, OSError):
                return
            if item == WAKER_STOP:
                return
            self._wake.set()

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super().run(role)
        finally:
            self._exits.close()
            if self._heartbeats is not None:
                self._heartbeats.close()
            # While the store still runs: a thread left blocked in the store's client would
            # end inside C++ when the interpreter finalizes.
            if self._waker is not None and self._node_store is not None:
                with contextlib.suppress(RuntimeError, OSError):
                    self._node_store.queue_push(WAKE_KEY, WAKER_STOP)
                self._waker.join(timeout=5)
                self._waker = None

    def _store_of_workers(self, worker_group: WorkerGroup) -> dist.Store:
        """This agent's store, under the prefix its workers of this incarnation use
        (distributed.store_prefix)."""
        assert self._node_store is not None
        spec = worker_group.spec
        return dist.PrefixStore(store_prefix(spec.rdzv_handler.get_run_id(), self.restart_count),
                                self._node_store)

    def _commit_store(self, worker_group: WorkerGroup) -> dist.Store | None:
        """Where a round's agents agree on its first plan: the rendezvous round's store,
        shared by every agent of the round (None for a round of one agent: no other can
        decide in it)."""
        return worker_group.store if self._round_agents > 1 else None

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
            if self.options.recovery == "live" and not self._said_why_not:
                log.warning("live recovery is off (%s): a failed worker restarts every "
                            "worker from the newest checkpoint", why_not)
                self._said_why_not = True
            if isinstance(self.process_context, PerWorkerProcesses):  # never two worlds at once
                self.process_context.close()
            self._plan = None
            return self._watched(self.torch_start_workers(worker_group))
        self._ensure_node_store(worker_group)
        self._round_agents = worker_group.group_world_size
        plan, raw = self._agree_on_round(worker_group)
        if plan is None:  # a round with plain torchrun agents in it
            if isinstance(self.process_context, PerWorkerProcesses):
                self.process_context.close()
            self._plan = None
            return self._watched(self.torch_start_workers(worker_group))
        return self._apply_round(worker_group, plan, raw)

    def _agree_on_round(self, worker_group: WorkerGroup) -> tuple[Plan | None, bytes]:
        """Every agent of the round says what it brings; group rank 0 decides and commits
        (one write and one read per agent, one multi-get for rank 0). (None, b"") when some
        agent of the round does not take part (plain torchrun joined the job): then this
        round starts the torch way."""
        arrival = self._arrival(worker_group, self._holding())
        store = self._commit_store(worker_group)
        if store is None:
            plan = plan_round([arrival], self.address, detected_at=time.time())
            return plan, take_over(self._job_store(worker_group), COMMITTED_KEY,
                                   plan.encode())
        keys = [f"{ROUND_PREFIX}/arrival/{r}" for r in range(worker_group.group_world_size)]
        store.set(keys[worker_group.group_rank], arrival.encode())
        if worker_group.group_rank == 0:
            try:
                store.wait(keys, timedelta(seconds=MIXED_ROUND_SECONDS))
                plan = plan_round([Arrival.decode(r) for r in store.multi_get(keys)],
                                  self.address, detected_at=time.time())
                raw = take_over(self._job_store(worker_group), COMMITTED_KEY,
                                plan.encode())
                raw = commit_plan(store, COMMITTED_KEY, b"", raw)
            except (RuntimeError, TimeoutError):  # torch's stores time out: DistStoreError
                raw = commit_plan(store, COMMITTED_KEY, b"", STOCK_ROUND)
        else:
            try:
                store.wait([keys[0]], timedelta(seconds=MIXED_ROUND_SECONDS))
            except (RuntimeError, TimeoutError):
                raw = STOCK_ROUND  # group rank 0 is not ours: it decides nothing
            else:
                raw = store.get(COMMITTED_KEY)
        if raw == STOCK_ROUND:
            log.warning("an agent of this rendezvous round is not elastic-train run's (plain "
                        "torchrun?): this round starts every worker the torch way, from the "
                        "newest checkpoint")
            return None, b""
        return Plan.decode(raw), raw

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
        woken = self._wake.wait(self._interval)
        if woken:  # what woke it is read below (keys stay set): a later push wakes it again
            self._wake.clear()
        workers = self.process_context
        if not isinstance(workers, PerWorkerProcesses) or self._plan is None:
            result = self.torch_monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY:
                self._look_again_if_unreported(w.id for w in worker_group.workers)
            return result
        failed, _ = workers.poll_failed()
        store = self._store_of_workers(worker_group)
        # Calls and reports wake this loop; without store queues (torch < 2.6) look each time.
        look = woken or self._waker is None or not self._waker.is_alive()
        notice = self._notice() if look else None
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

    def _notice(self) -> Notice | None:
        """A peer's call to re-form, when it asks for a generation not handled yet."""
        assert self._node_store is not None and self._plan is not None
        raw = local_value(self._node_store, NOTICE_KEY)
        if raw is None:
            return None
        notice = Notice.decode(raw)
        if notice.generation <= max(self._plan.generation, self._noticed):
            return None
        return notice

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
        assert self._plan is not None
        detected_at = time.time()
        base = self._plan
        if notice is not None and notice.coordinator in silent:
            notice = None  # a silent coordinator's call: this agent coordinates instead
        if notice is not None:
            coordinator, generation = notice.coordinator, notice.generation
            self._noticed = generation
        else:
            coordinator, generation = self.address, base.generation + 1
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
        plan, raw = None, None
        for _ in range(REFORM_ATTEMPTS):
            if coordinator == self.address:
                outcome = self._coordinate(worker_group, base, generation, arrival,
                                           detected_at, silent)
            else:
                outcome = self._follow(coordinator, generation, arrival)
            if isinstance(outcome, tuple):
                plan, raw = outcome
                break
            if outcome == UNCOMMITTED:
                break
            if outcome == RESTART:  # no member holds the state
                self._release_workers(worker_group)
                return False
            # the coordinator is gone: this agent coordinates the next generation
            coordinator, generation = self.address, generation + 1
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
            forget_nodes(worker_group.spec.rdzv_handler,
                         [m.rdzv_node for m in plan.lost_from(base)])
        return True

    def _coordinate(self, worker_group: WorkerGroup, base: Plan, generation: int,
                    arrival: Arrival, detected_at: float,
                    silent: set[str] | frozenset[str] = frozenset()
                    ) -> tuple[Plan, bytes] | bytes | None:
        """Call the members of ``base`` to generation ``generation`` (not the ``silent``
        ones: they are lost), take those that come within ``ARRIVE_SECONDS`` (an agent that
        died refuses the call at once), commit the plan. RESTART when none holds the state;
        None when another coordinator's call came first and it is gone."""
        assert self._node_store is not None
        peers = [a for a in base.agents if a != self.address and a not in silent]
        called = self._peers.tell_all(peers, NOTICE_KEY,
                                      Notice(generation, self.address).encode())
        arrivals = {self.address: arrival}
        deadline = time.monotonic() + ARRIVE_SECONDS
        while called - arrivals.keys() and time.monotonic() < deadline:
            for agent in called - arrivals.keys():
                raw = local_value(self._node_store, arrival_key(generation, agent))
                if raw is not None:
                    arrivals[agent] = Arrival.decode(raw)
            rival = self._notice()
            if rival is not None and rival.generation >= generation \
                    and rival.coordinator < self.address:
                # two agents called at once: the one with the smaller id coordinates
                outcome = self._follow(rival.coordinator, rival.generation, arrival)
                if isinstance(outcome, tuple):
                    self._node_store.set(plan_key(generation), outcome[1])
                return outcome
            time.sleep(0.005)
        plan = plan_reformation(base, arrivals, self.address, generation=generation,
                                detected_at=detected_at)
        if plan is not None and len(plan.members) < self.options.min_nodes:
            log.warning("%d node(s) left, fewer than the job's minimum (--nnodes %d:...): "
                        "the world is not re-formed in place; every node restarts from the "
                        "newest checkpoint once enough nodes are there", len(plan.members),
                        self.options.min_nodes)
            plan = None
        if plan is None:
            self._node_store.set(plan_key(generation), RESTART)
            return RESTART
        try:
            raw = self._commit(worker_group, plan.encode())
        except Exception as exc:  # the rendezvous' store unreachable: cut off from it
            log.warning("could not commit generation %d (%s: %s): this node may be cut off "
                        "from the others; it restarts its workers and joins again",
                        generation, type(exc).__name__, str(exc).splitlines()[0][:200])
            self._node_store.set(plan_key(generation), RESTART)
            return UNCOMMITTED
        self._node_store.set(plan_key(generation), raw)
        return Plan.decode(raw), raw

    def _commit(self, worker_group: WorkerGroup, raw: bytes) -> bytes:
        """Swap the job's plan from the one this agent applies to ``raw``; what is
        committed now (another's plan if another agent, or a newer world, was first).

        On c10d the job's store is a TCPStore in one agent: should that node fall silent
        (or this one be cut off), torch's client would wait forever; the call gives up after
        ``STORE_ANSWER_SECONDS`` (``TimeoutError``: nothing committed)."""
        store = self._job_store(worker_group)
        if worker_group.spec.rdzv_handler.get_backend() != "c10d":
            return commit_plan(store, COMMITTED_KEY, self._plan_raw, raw)
        return bounded(lambda: commit_plan(store, COMMITTED_KEY, self._plan_raw, raw),
                       STORE_ANSWER_SECONDS)

    def _end_if_c10d_store_lost(self) -> None:
        """(A thread, when a peer fell silent on c10d.) torch's c10d handler waits without
        bound on its store, in this agent's loop: if the silent peer held the store, the
        loop does not come back until the store answers again. So the store is asked here,
        with a bound. No answer within ``STORE_ANSWER_SECONDS``: the store's node is lost,
        or this node is cut off; either way this node's workers hold a superseded state and
        are ended. The agent then waits up to ``store_lost_seconds`` for its loop to come
        back (a cable put back: the blocked call completes, and the loop rejoins the job);
        if it does not, it ends with one line."""
        suspected_at = time.monotonic()
        store = self._job_store(self.get_worker_group())
        try:
            bounded(lambda: store.check([COMMITTED_KEY]), STORE_ANSWER_SECONDS)
            return
        except TimeoutError:
            pass
        except Exception:  # refused or reset: torch's handler raises on its own
            return
        if self._loop_at > suspected_at:
            return  # the loop went on meanwhile: it handles the silent peer itself
        log.warning("the c10d rendezvous store does not answer: its node is lost, or this "
                    "node is cut off; this node ends its workers and waits up to %g s for "
                    "the store (--rdzv-conf join_timeout)", self.options.store_lost_seconds)
        if isinstance(self.process_context, PerWorkerProcesses):
            self.process_context.end_now()
        deadline = suspected_at + self.options.store_lost_seconds
        while time.monotonic() < deadline:
            if self._loop_at > suspected_at:
                return  # the store answered the loop: it rejoins the job
            time.sleep(0.1)
        if isinstance(self.process_context, PerWorkerProcesses):
            self.process_context.close(signal.SIGKILL, 5)
        stop_worker_server()  # the spare's and the workers' server: nobody else will
        error = store_lost(self.get_worker_group().spec.rdzv_handler.get_run_id(),
                           self.options.store_lost_seconds)
        print(f"elastic-train: error: {error}", file=sys.stderr, flush=True)
        exit_now(1)

    def _follow(self, coordinator: str, generation: int, arrival: Arrival
                ) -> tuple[Plan, bytes] | bytes | None:
        """Arrive at ``coordinator``'s call; its plan (RESTART, or None if it is gone)."""
        if not self._peers.tell(coordinator, arrival_key(generation, self.address),
                                arrival.encode()):
            return None
        raw = self._peers.read(coordinator, plan_key(generation), FOLLOW_SECONDS)
        if raw is None or raw == RESTART:
            return raw
        return Plan.decode(raw), raw

    # ---- telling the workers ----------------------------------------------------------------
    def _adopt(self, worker_group: WorkerGroup, plan: Plan, raw: bytes) -> None:
        """Take ``plan`` as this agent's generation: torch's view of the workers follows."""
        self._plan, self._plan_raw = plan, raw
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
        def make(original: Callable[..., PContext]) -> Callable[..., PerWorkerProcesses]:
            def start_processes(name: str, entrypoint: Any, args: dict[int, tuple],
                                envs: dict[int, dict[str, str]], logs_specs: LogsSpecs,
                                **kwargs: Any) -> PerWorkerProcesses:
                kwargs.pop("log_line_prefixes", None)

                def start_one(local_rank: int, env: dict[str, str]) -> PContext:
                    context = original(name=name, entrypoint=entrypoint,
                                       args={0: args[local_rank]}, envs={0: env},
                                       logs_specs=worker_logs_specs(logs_specs, local_rank),
                                       **kwargs)
                    for pid in context.pids().values():
                        self._exits.watch(pid)
                    return context

                return PerWorkerProcesses(start_one, {
                    lr: live_worker_env(env, live_store, generation)
                    for lr, env in envs.items()},
                    spare_store=self._node_store if self.options.hot_spare else None)

            return start_processes

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
