"""Live recovery, the agent's side: re-form the world in place, on one node or across nodes.

torch's ``LocalElasticAgent`` starts a node's workers as one process context, and a
context whose process fails closes the rest; any failure or membership change then stops
every worker of every node and restarts them from the newest checkpoint.
``LiveRecoveryAgent`` starts each worker in a context of its own (``PerWorkerProcesses``)
and moves the world from one *generation* to the next instead (plans: live/plan.py; how
the agents agree on each, and why a stale or cut-off coordinator commits none:
live/coordination.py):

- **After every rendezvous round** (the start, a node joining, torch's restart path) the
  agents of the round agree on its first plan. If some agent's workers hold the state,
  they keep running and every other worker starts without it and receives it from them
  (``live``); else every worker starts from the newest checkpoint (``fresh``). While the
  round forms, the workers train on: a node that joins costs them only the pause at a step
  boundary (torch's agent restarts every worker here).
- **When a worker dies**, its agent starts it again at once (a fork from the forkserver)
  and calls the other agents to re-form; **when a worker's collective fails** (a peer
  died, maybe with its whole node) or **a peer falls silent** (agent/silent_peers.py), its
  agent does the same; but when a node waits to join just then, the world re-forms in
  that rendezvous round instead (a member may wait there already, deaf to calls).
- **Telling the workers** (agent/worker_messages.py): each agent writes the plan into its
  own store with a mode (``abort``: fail your collectives and re-form now; ``boundary``:
  re-form after your step once the new workers are built; ``start``) and bumps the
  generation its workers watch (worker/live_world.py).

It falls back to torch's restart path, unchanged, when live recovery cannot help: no worker
holds the state anymore, the world had not restored its state yet or had left the training
loop, the job asked for ``--recovery restart``, or it spans nodes on a backend that does
not re-form across nodes (rendezvous/backends.py). Restarts of failed workers in place
count against ``--max-restarts`` like group restarts; changes of membership spend none: a
node the others re-formed without (cut off, frozen) ends its workers and joins a new round;
a node joining when a peer is lost goes on into the next generation.

Every stop of the workers is told apart: torch's own stops (its restart path) leave a note
that makes the workers' SIGTERM a restart, not a preemption (agent/environment.py's
``agent_stopping``); a SIGTERM to the agent is a preemption of this node, which leaves alone
when the other nodes were not signalled (worker/vote.decide). The agent never ends as if
the job were done unless its workers all finished (``NodeLeftError`` otherwise).

This module holds torch's hooks (through agent/torch_seams.py's ``TorchAgent``) and the
translation between plans and torch's worker group. The agent's store, id, coordinator and
failure detector: agent/live_node.py; the job's plan key: agent/job_store.py; the
per-worker contexts: agent/worker_processes.py; the watch on a silent c10d store:
agent/store_watch.py; what ends the loop's wait: agent/wake.py, agent/exit_watch.py. The
options reach each agent as a ``LiveOptions`` through ``live_agent_installed``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic_train.agent.environment import agent_stopping
from elastic_train.agent.exit_watch import ExitWatch
from elastic_train.agent.failure_detector import TIMEOUT as DETECTOR_TIMEOUT
from elastic_train.agent.holder_directory import HolderDirectory
from elastic_train.agent.job_store import ACROSS_NODES, job_store
from elastic_train.agent.live_node import LiveNode
from elastic_train.agent.live_options import C10D_JOIN_TIMEOUT, LiveOptions
from elastic_train.agent.round_ranks import (
    ROUND_ATTEMPTS,
    assign_round_ranks,
    rendezvous_until_ranked,
)
from elastic_train.agent.snapshot_holder import SnapshotHolder
from elastic_train.agent.store_watch import end_if_store_lost
from elastic_train.agent.torch_seams import TorchAgent, agent_class_replaced
from elastic_train.agent.wake import Wakeup
from elastic_train.agent.worker_messages import WorkerMessages
from elastic_train.agent.worker_processes import (
    PerWorkerProcesses,
    live_worker_env,
    per_worker_contexts,
)
from elastic_train.config import RecoveryMode
from elastic_train.errors import NodeLeftError, RoundMemberLostError
from elastic_train.live.coordination import RESTART, Notice, Round, lost_members
from elastic_train.live.environment import LIVE_GENERATION
from elastic_train.live.peers import bounded
from elastic_train.live.plan import LIVE, Arrival, Plan
from elastic_train.rendezvous.forget import (
    defer_lease_losses,
    forget_nodes,
    leave_open,
    rendezvous_node_id,
    round_node_ids,
)

__all__ = ["ACROSS_NODES", "LiveOptions", "LiveRecoveryAgent", "PerWorkerProcesses",
           "live_agent_installed", "live_worker_env"]

log = logging.getLogger(__name__)

ROUND_PROBE_SECONDS = 2.0
"""How long the agent asks the rendezvous whether a node waits to join, when the world
must change (its store may be the one that was lost)."""
LEASE_GRACE_MARGIN = 1.0
"""Seconds beyond the failure detector's timeout that a member's expired lease waits
before it re-forms the world by a new round (rendezvous/forget.py's ``defer_lease_losses``)."""
REFORMED, RESTARTED, LEFT_OUT = "reformed", "restarted", "left out"
"""What a re-formation came to for this node (``LiveRecoveryAgent._reform``)."""


class LiveRecoveryAgent(TorchAgent):
    """torch's local agent, with workers started again one by one and worlds re-formed in
    place across agents (see the module)."""

    def __init__(self, *args: Any, options: LiveOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options or LiveOptions()
        self._max_restarts = self.get_worker_group().spec.max_restarts
        """--max-restarts as given (torch's spec counts this node's rejoins too)."""
        self._live_left = self._max_restarts
        self._node: LiveNode | None = None
        """Its store, id, coordinator and failure detector, once live (agent/live_node.py)."""
        self._said_why_not = False
        self._round_agents = 1  # agents of the rendezvous round (torch's group world size)
        self._round_ours: tuple[int, ...] = ()
        """The round's members known to be ours (its rank 0 learns it: agent/round_ranks.py)."""
        # torch's loop sleeps --monitor-interval before each check; here the check waits
        # for it instead, and a call or a worker's report (WAKE_KEY) ends the wait at once.
        spec = self.get_worker_group().spec
        self._interval, spec.monitor_interval = spec.monitor_interval, 0.0
        self._wake = Wakeup()
        self._exits = ExitWatch(self._wake.event)  # a worker's death wakes the loop too
        self._holders = HolderDirectory(self.options.memory_tier) \
            if self.options.memory_tier is not None else None
        """Where this agent's snapshot holder finds the others' (agent/holder_directory.py)."""
        self._loop_at = 0.0
        """When the monitor loop last ran (a thread tells from it whether the loop is stuck
        in torch's c10d handler)."""

    @property
    def _plan(self) -> Plan | None:
        """The generation this agent applies (None: none, or torch's way)."""
        return self._node.plan if self._node is not None else None

    @property
    def address(self) -> str:
        """This agent's id in a plan: HOST:PORT of its store ("" until it is live)."""
        return self._node.address if self._node is not None else ""

    def _drop_plan(self) -> None:
        if self._node is not None:
            self._node.coordinator.adopt(None)

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

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            result = super().run(role)
            return self._never_success_by_mistake(result)
        except SignalException as exc:  # what the launcher says depends on what followed
            exc.node_left_at = self._left_at()  # type: ignore[attr-defined]
            raise
        except Exception:
            # this node's error, not the job's end: torch's launcher would close the
            # rendezvous, and every other node with it (rendezvous/forget.py)
            leave_open(self.get_worker_group().spec.rdzv_handler)
            raise
        finally:
            self._exits.close()
            if self._node is not None:
                self._node.close()
            self._wake.close(self._node.store if self._node is not None else None)

    def _never_success_by_mistake(self, result: RunResult | None) -> RunResult:
        """Only workers that all finished make a success: torch returns the last result
        it saw when a node's restarts are spent (UNHEALTHY, read as success by its
        launcher: exit 0 while the others train on), and None when the rendezvous closed
        while this node waited to join."""
        if result is None:
            raise NodeLeftError("the rendezvous closed while this node waited to join: the "
                                "job ended without it")
        if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
            return result
        if result.failures:
            return RunResult(state=WorkerState.FAILED, failures=result.failures)
        raise NodeLeftError(
            f"this node's workers could not go on ({result.state.name.lower()}) and its "
            f"--max-restarts ({self._max_restarts}) are spent: it "
            "leaves the job, which goes on without it; start it again to rejoin")

    def _left_at(self) -> int | None:
        """The step this node's workers left the job at alone (the others went on)."""
        if self._node is None:
            return None
        with contextlib.suppress(Exception):
            return self._messages(self.get_worker_group()).left_at()
        return None

    def stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        """torch's own stops (its restart path, restarts spent): the workers learn that the
        SIGTERM is their agent's, not a preemption (agent/environment.py's stop note)."""
        with agent_stopping("restart"):
            self.torch_stop_workers(worker_group, *args, **kwargs)

    def _messages(self, worker_group: WorkerGroup) -> WorkerMessages:
        """This agent's store as its workers of this incarnation use it."""
        assert self._node is not None
        return self._node.messages(worker_group.spec.rdzv_handler.get_run_id(),
                                   self.restart_count)

    def _job_store(self, worker_group: WorkerGroup) -> dist.Store:
        """Where the job's current plan is kept (agent/job_store.py)."""
        return job_store(worker_group, self._node.store if self._node is not None else None)

    # ---- starting: the first generation of a rendezvous round ------------------------------
    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """The round's first generation; when the round's rank 0 was lost before it
        committed the round's plan, the next round without it (``ROUND_ATTEMPTS`` at most)."""
        for _ in range(ROUND_ATTEMPTS - 1):
            try:
                return self._start_round(worker_group)
            except RoundMemberLostError as exc:
                log.warning("%s: this node goes into the next rendezvous round", exc)
                forget_nodes(handler := worker_group.spec.rdzv_handler,  # the workers may
                             round_node_ids(handler, exc.missing), stalled=True)  # wait for it
                self.rendezvous(worker_group)
        return self._start_round(worker_group)  # the last attempt: its error is the agent's

    def _start_round(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._holders is not None:  # torch's ranks of the round, before a plan's
            self._holders.publish(worker_group.store, worker_group.group_rank or 0,
                                  worker_group.group_world_size or 1)
        why_not = self._live_possible(worker_group)
        if why_not is not None:
            if self.options.recovery == RecoveryMode.LIVE and not self._said_why_not:
                log.warning("live recovery is off (%s): a failed worker restarts every "
                            "worker from the newest checkpoint", why_not)
                self._said_why_not = True
            if isinstance(self.process_context, PerWorkerProcesses):  # never two worlds at once
                with agent_stopping("restart"):
                    self.process_context.close()
            self._drop_plan()
            return self._exits.watch_started(self.torch_start_workers(worker_group))
        if self._node is None:
            self._node = LiveNode(worker_group, self.options, self._wake,
                                  self._end_if_c10d_store_lost)
            # a member's expired lease (etcd-v3) waits for the failure detector to leave
            # it out in place, rather than re-forming every node by a new round
            defer_lease_losses(worker_group.spec.rdzv_handler,
                               self.options.peer_timeout + LEASE_GRACE_MARGIN)
        self._round_agents = worker_group.group_world_size
        round_ = Round(worker_group.store, worker_group.group_rank,
                       worker_group.group_world_size, frozenset(self._round_ours),
                       self._node.silent_in_round(worker_group.spec.rdzv_handler)) \
            if self._round_agents > 1 else None
        plan, raw = self._node.coordinator.agree_on_round(
            self._arrival(worker_group, self._holding()), round_, self._job_store(worker_group))
        if plan is None:  # a round with plain torchrun agents in it
            if isinstance(self.process_context, PerWorkerProcesses):
                with agent_stopping("restart"):
                    self.process_context.close()
            self._drop_plan()
            return self._exits.watch_started(self.torch_start_workers(worker_group))
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
            self._messages(worker_group).announce(self.address, plan, "start")
            with per_worker_contexts(self.address, plan.generation, self._exits.watch,
                                     self._node.store if self.options.hot_spare else None):
                started = self.torch_start_workers(worker_group)
            log.info("generation %d (%s) of %d workers: started %d here (%s)", plan.generation,
                     plan.kind, plan.world_size, len(started), plan.cause)
            return started
        self._adopt(worker_group, plan, raw)
        if not plan.same_world(before):
            # Workers of the world before that do not go on: the others may wait on them.
            peers_lost = before is None or any(len(plan.keeps(m.agent)) < m.workers
                                               for m in before.members)
            self._messages(worker_group).announce(self.address, plan,
                                                   "abort" if peers_lost else "boundary")
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
            if isinstance(workers, PerWorkerProcesses) and workers.ended_here():
                return self._rejoin_after_own_stop(worker_group, workers)
            if result.state == WorkerState.HEALTHY:
                self._exits.wake_if_unreported(w.id for w in worker_group.workers)
            return result
        failed, _ = workers.poll_failed()
        if workers.ended_here():
            return self._rejoin_after_own_stop(worker_group, workers)
        messages = self._messages(worker_group)
        # Calls and reports wake this loop; without store queues (torch < 2.6) look each time.
        look = woken or not self._wake.watching()
        notice = self._node.coordinator.notice() if look and self._node else None
        reported = look and messages.failed_collective(self._plan.generation)
        silent = self._node.silent() if self._node else set()
        if look and self._node:  # members that said they leave (torch's restart path)
            silent |= self._node.coordinator.leavers()
        if reported:  # nodes signalled alone leave: neither called nor waited for
            members = self._plan.members
            silent |= {members[i].agent for i in messages.leaving(self._plan.generation)
                       if i < len(members) and members[i].agent != self.address}
        if not (failed or notice or reported or silent):
            if workers.wants_spare() and messages.holding():
                workers.start_spare()
            self._exits.wake_if_unreported(workers.pids(running_only=True).values())
            with workers.as_polled():  # a failure the poll above missed waits for the next
                return self.torch_monitor_workers(worker_group)
        why_not = "the live restarts of --max-restarts are spent" \
            if failed and self._live_left <= 0 else messages.why_not_live()
        if why_not is not None and not failed and self._joining(messages):
            # This node's workers were started into a world the others hold: they go on to
            # receive the state in the next generation (worker/runtime.recover), nothing to
            # restart (a restart here cost a join interrupted by a fault 15-20 s and a
            # --max-restarts each time: found by the fault campaign).
            why_not = None
        if why_not is not None:
            log.warning("the world cannot re-form in place (%s): every worker of this node "
                        "restarts from the newest checkpoint", why_not)
            self._leave_world()
            self._messages(worker_group).release()
            return self.torch_monitor_workers(worker_group) if failed \
                else RunResult(state=WorkerState.UNHEALTHY)
        if notice is None and not silent and self._round_waiting(worker_group):
            return self._into_round(worker_group, failed)
        outcome = self._reform(worker_group, workers, failed, notice, silent)
        if outcome == REFORMED:
            return RunResult(state=WorkerState.HEALTHY)
        if outcome == LEFT_OUT:  # a change of membership, not a failure: no restart spent
            self._rejoin(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        return RunResult(state=WorkerState.UNHEALTHY, failures={
            worker_group.workers[lr].global_rank: failure for lr, failure in failed.items()})

    def _leave_world(self) -> None:
        """This node takes torch's restart path out of a world with other members: they
        learn it at once and re-form without it (live/coordination.py's ``leave``), then
        take it back through its new rendezvous round. Unsaid, the first to notice called
        it and waited ``ARRIVE_SECONDS``, and its round closed alone meanwhile (the fault
        campaign, etcd-v3 seed 561)."""
        if self._node is None or self._plan is None or len(self._plan.members) < 2:
            return
        generation = self._plan.generation
        told = self._node.coordinator.leave()
        log.warning("this node leaves the world of generation %d and joins again through a "
                    "new rendezvous round; told %d of its %d other member(s)", generation,
                    len(told), len(self._plan.members) - 1)

    def _round_waiting(self, worker_group: WorkerGroup) -> bool:
        """Whether a node waits in the rendezvous for a new round (torch's agent takes
        that round at its next check of healthy workers). Asked only when the world must
        change, bounded: a store that does not answer counts as no round."""
        handler = worker_group.spec.rdzv_handler
        try:
            return bounded(handler.num_nodes_waiting, ROUND_PROBE_SECONDS) > 0
        except Exception as exc:  # any store's error: re-form in place as before
            log.info("could not tell whether a node waits to join (%s: %s)",
                     type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            return False

    def _into_round(self, worker_group: WorkerGroup, failed: Mapping[int, Any]) -> RunResult:
        """A worker failed or a collective broke while a node waits to join: the world
        re-forms in that node's rendezvous round rather than by a call to the members,
        since a member may already wait in that round and would not come to the call
        (the fault campaign, seed 107: a worker killed just after a thawed node asked to
        rejoin; the caller waited ``ARRIVE_SECONDS`` for it and went on alone, the two
        others left out). The workers that hold the state keep it through the round;
        a failed one starts again from them, as a joining node's do."""
        if failed:
            self._live_left -= 1
            log.warning("worker rank(s) %s failed (exit code %s) while a node waits to "
                        "join: the world re-forms in that rendezvous round",
                        sorted(worker_group.workers[lr].global_rank for lr in failed),
                        [f.exitcode for f in failed.values()])
        else:
            log.warning("a collective failed while a node waits to join: the world "
                        "re-forms in that rendezvous round")
        self.restart_workers(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _joining(self, messages: WorkerMessages) -> bool:
        """Whether this node's workers are joining a world the other members hold (started
        into a live plan that keeps none of them, and not holding the state yet)."""
        plan = self._plan
        return plan is not None and plan.kind == LIVE and not plan.keeps(self.address) \
            and not messages.ready() and not messages.finished()

    def _rejoin(self, worker_group: WorkerGroup) -> None:
        """The others re-formed the world without this node (it was cut off, frozen, or too
        slow to answer): a new rendezvous round and a start from what the world holds, as
        torch does for a node that joins. Its workers are a new incarnation (their restart
        count, and so their keys in this agent's store, are new: the old ones say that no
        generation comes), but none of --max-restarts is spent on it."""
        worker_group.spec.max_restarts += 1  # the count goes up, what is left stays
        self.torch_restart_workers(worker_group)

    def _rejoin_after_own_stop(self, worker_group: WorkerGroup,
                               workers: PerWorkerProcesses) -> RunResult:
        """This agent ended its workers itself while its loop was held (the c10d store did
        not answer: agent/store_watch.py), and the loop is back: their state is superseded,
        so the node joins again as a left-out one does. Their exits are no failure: counted,
        they spent --max-restarts' live restarts, and a node cut off twice ended the job
        (the fault campaign, c10d seed 642)."""
        log.warning("this node's workers (local rank(s) %s) were ended by their own agent "
                    "while the rendezvous store did not answer: the node joins again (no "
                    "restart of --max-restarts spent)", workers.ended_here())
        self._rejoin(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _reform(self, worker_group: WorkerGroup, workers: PerWorkerProcesses,
                failed: Mapping[int, Any], notice: Notice | None,
                silent: set[str] | frozenset[str] = frozenset()) -> str:
        """Re-form the world without what was lost (``silent``: members the failure
        detector suspects or that leave alone, neither called nor waited for): REFORMED;
        RESTARTED: this node takes torch's restart path (no one holds the state);
        LEFT_OUT: the others went on without this node, which joins again."""
        assert self._node is not None and self._node.plan is not None
        coordination = self._node.coordinator
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
            self._messages(worker_group).release()
            return RESTARTED
        plan, raw = outcome if isinstance(outcome, tuple) else (None, None)
        if plan is None or raw is None or self.address not in plan.agents:
            log.warning("the others re-formed the world without this node: it ends its "
                        "workers (their state is superseded) and joins again")
            self._messages(worker_group).release()
            workers.end_now()
            return LEFT_OUT
        self._adopt(worker_group, plan, raw)
        self._messages(worker_group).announce(self.address, plan, "abort")
        log.warning("the world re-formed in place as generation %d: %d workers on %d nodes "
                    "(%s)", plan.generation, plan.world_size, len(plan.members), plan.cause)
        if plan.lost:  # the rendezvous learns it too (torch's state: its coordinator)
            forget_nodes(worker_group.spec.rdzv_handler, lost_members(plan, base),
                         coordinator=plan.group_store == self.address)
        return REFORMED

    def _end_if_c10d_store_lost(self) -> None:
        """(A thread, when a peer fell silent on c10d: agent/store_watch.py.)"""
        workers = self.process_context
        end_if_store_lost(self._job_store(self.get_worker_group()), lambda: self._loop_at,
                          workers if isinstance(workers, PerWorkerProcesses) else None,
                          self.options.store_lost_seconds,
                          self.get_worker_group().spec.rdzv_handler.get_run_id())

    # ---- rendezvous rounds -------------------------------------------------------------------
    def rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's round; the next one without a member lost right after it (round_ranks.py)."""
        handler = worker_group.spec.rdzv_handler
        rendezvous_until_ranked(  # the workers may wait for the lost one: no last call
            lambda: self.torch_rendezvous(worker_group),
            lambda ranks: forget_nodes(handler, round_node_ids(handler, ranks), stalled=True))

    def assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                            spec: WorkerSpec) -> list[Worker]:
        """torch's numbering, its waits bounded (agent/round_ranks.py)."""
        self._round_ours = ()
        if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":  # no store: torch's
            return super().assign_worker_ranks(store, group_rank, group_world_size, spec)
        node, handler = self._node, spec.rdzv_handler
        r = assign_round_ranks(store, group_rank, group_world_size, spec.role,
                               spec.local_world_size, node and node.silent_in_round(handler))
        self._round_ours = r.ours
        return [Worker(local_rank=i, global_rank=r.base_global_rank + i,
                       role_rank=r.base_role_rank + i, world_size=r.global_world_size,
                       role_world_size=r.role_world_size)
                for i in range(spec.local_world_size)]

    # ---- plans and torch's worker group -----------------------------------------------------
    def _adopt(self, worker_group: WorkerGroup, plan: Plan, raw: bytes) -> None:
        """Take ``plan`` as this agent's generation: torch's view of the workers follows."""
        assert self._node is not None
        self._node.adopt(plan, raw)
        ranks = plan.ranks(self.address)
        for worker in worker_group.workers:
            worker.global_rank = worker.role_rank = ranks[worker.local_rank]
            worker.world_size = worker.role_world_size = plan.world_size
        worker_group.group_rank = plan.node_index(self.address)
        worker_group.group_world_size = len(plan.members)

    def _arrival(self, worker_group: WorkerGroup, alive: tuple[int, ...]) -> Arrival:
        plan = self._plan
        node = rendezvous_node_id(worker_group.spec.rdzv_handler)
        beat = self._node.beat if self._node is not None else ""
        if plan is None or self.address not in plan.agents:
            return Arrival(self.address, worker_group.spec.local_world_size, rdzv_node=node,
                           beat=beat)
        first = plan.first_rank(self.address)
        return Arrival(self.address, worker_group.spec.local_world_size, alive, first,
                       plan.generation, plan.world_size, writer=first == 0 and 0 in alive,
                       rdzv_node=node, beat=beat)

    def _holding(self) -> tuple[int, ...]:
        """Local ranks whose workers hold the state now (run, restored, in the loop)."""
        workers = self.process_context
        if not isinstance(workers, PerWorkerProcesses) or self._plan is None:
            return ()
        workers.poll_failed()
        if not self._messages(self.get_worker_group()).holding():
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
            log.info("a node waits to join: this node goes into the new rendezvous round "
                     "while its workers train on")
            with self._node.left_out_of_the_round(worker_group.spec.rdzv_handler) \
                    if self._node is not None else contextlib.nullcontext():
                self.rendezvous(worker_group)
            for local_rank, pid in self.start_workers(worker_group).items():
                worker_group.workers[local_rank].id = pid
            worker_group.state = WorkerState.HEALTHY
            return
        self.torch_restart_workers(worker_group)


@contextlib.contextmanager
def live_agent_installed(recovery: str, listen_host: str | None = None,
                         hot_spare: bool = False, peer_timeout: float = DETECTOR_TIMEOUT,
                         store_lost_seconds: float = C10D_JOIN_TIMEOUT, min_nodes: int = 1,
                         memory_tier: SnapshotHolder | None = None) -> Iterator[None]:
    """Make torch's launcher run ``LiveRecoveryAgent`` (for ``elastic-train run``), each
    agent built with these options (no option lives on the class)."""
    options = LiveOptions(recovery, listen_host, hot_spare, peer_timeout, store_lost_seconds,
                          min_nodes, memory_tier)
    with agent_class_replaced(functools.partial(LiveRecoveryAgent, options=options)):
        yield
