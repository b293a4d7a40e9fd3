"""One worker's protocol, in one place: start, restore, the per-step vote, stops, shutdown.

The built-in trainer (trainer.py) and ElasticSession (session.py) are loops over this: each
owns its step; the runtime owns what every rank must do in the same order around it.

- ``start``: the ``start`` event, the rendezvous (and resize) that formed this world, and
  the save-failure policy's refusal to restart a job it stopped.
- ``restore``: every rank loads the newest valid checkpoint (checkpoint/manager.py).
- ``vote`` at the end of every step: one small all-reduce carries the loss and every reason
  to leave the loop (a SIGTERM on any rank; rank 0's failed checkpoint write under
  ``--on-save-failure stop``), so every rank leaves at the same step.
- ``save_if_due`` between steps; ``end`` after the loop: a failed-save stop raises the same
  line on every rank; else the preemption or final checkpoint, a barrier, and the ``end``
  event when the run is over (not after a stop: the launch may go on).
- ``close``, then ``raise_if_node_stopped``: a node that was not signalled but stopped with
  the signalled ones fails, so that its agent re-forms the world without them.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic_train.checkpoint.manager import CheckpointManager, Restored, Stateful
from elastic_train.config import CheckpointConfig, RecoveryMode
from elastic_train.errors import LiveRecoveryError, NodeLeftAloneError, NodeStoppedError
from elastic_train.events.log import (
    EventLog,
    EventObserver,
    PreviousIncarnation,
    previous_incarnation,
)
from elastic_train.events.schema import (
    End,
    Hang,
    Preempted,
    Recovery,
    Rendezvous,
    Resize,
    Restart,
    Start,
)
from elastic_train.rundir import Publisher, RunDir
from elastic_train.worker import aborts, distributed, sharded_recovery
from elastic_train.worker.distributed import Group
from elastic_train.worker.env import WorkerEnv
from elastic_train.worker.live_world import LiveWorld, LostMembers
from elastic_train.worker.memory_tier import MemoryTierClient
from elastic_train.worker.preemption import StopRequest, node_stopped
from elastic_train.worker.replica_check import ReplicaCheck
from elastic_train.worker.save_failure import SaveFailureStop
from elastic_train.worker.sharded_recovery import ShardedLive
from elastic_train.worker.straggler_check import StragglerCheck
from elastic_train.worker.vote import GO_ON, LEAVE_GRACE, TALLY_NODES, Vote, decide, make_tally
from elastic_train.worker.watchdog import NoWatchdog, StepWatchdog

OWN_FAILURE_GRACE = 2.0
"""Seconds a step that failed outside a collective (the loop's own error) waits for a
re-formation announced meanwhile before it fails the worker."""


@dataclass(frozen=True)
class Rejoined:
    """The world re-formed in place (live recovery): where every member goes on from."""

    group: Group
    step: int
    """The newest step any member held: every member holds its state now."""
    steps_redone: int
    bytes: int
    source_rank: int
    from_checkpoint: bool = False
    """A sharded model whose parts the members did not all hold: every member loaded the
    newest checkpoint (``step`` is its step) instead of receiving the state."""


def say_on_stderr(text: str) -> None:
    """How a hand-written loop's rank 0 is told what the runtime did."""
    print(f"elastic_train: {text}", file=sys.stderr, flush=True)


class WorkerRuntime:
    """The protocol of one worker in one incarnation (one process group).

    ``preemption_budget``: seconds a SIGTERM'd job has to checkpoint and exit; None leaves
    SIGTERM to Python. ``meta`` goes into every checkpoint's manifest. ``observers`` see
    every event on this rank; ``say`` shows rank 0's messages to the user;
    ``save_failure_option`` is how the user names the save-failure policy (in messages).
    """

    def __init__(self, run_dir: RunDir, env: WorkerEnv, group: Group, policy: CheckpointConfig,
                 *, preemption_budget: float | None, meta: Mapping[str, Any] | None = None,
                 observers: Sequence[EventObserver] = (),
                 say: Callable[[str], None] = say_on_stderr,
                 save_failure_option: str = "--on-save-failure") -> None:
        self.run_dir = run_dir
        self.env = env
        self.group = group
        self.events = EventLog(run_dir.events, enabled=group.rank == 0, observers=observers)
        self.publisher = Publisher(run_dir)
        """Uploads this worker's logs of an object-store run directory (rundir.py)."""
        if group.rank == 0:
            self.publisher.track(run_dir.events)
        self.checkpoints = CheckpointManager(run_dir.checkpoint_store(), group,
                                             policy, self.events,
                                             dict(meta or {"run_id": env.run_id}),
                                             fence=run_dir.writer_fence(),
                                             on_commit=self.publisher.publish_now,
                                             memory=MemoryTierClient.from_env())
        self.save_failure = SaveFailureStop(self.checkpoints, group, self.events,
                                            env.restart_count, save_failure_option)
        self.preemption = StopRequest(preemption_budget, note=env.stop_note) \
            if preemption_budget is not None else None
        self.say = say
        self.stopped_at: int | None = None
        """The step the job stopped at (a SIGTERM), or None."""
        self.stopped_nodes: tuple[int, ...] = ()
        self.restarting = False
        """The stop was an agent's restart of its workers, not a preemption."""
        self.left = False
        """This node left the job alone at ``stopped_at`` (the others went on)."""
        self.live: LiveWorld | None = None
        """Set when this worker's world re-forms in place after a lost worker."""
        self.replicas: ReplicaCheck | None = None  # --verify-every (worker/replica_check.py)
        self.stragglers = StragglerCheck("off", 1.5, 1, self.events)  # the loop's options
        self._previous: PreviousIncarnation | None = None
        self._installed = False
        self._joined_at: float | None = None
        """When this worker, started into a running world, joined it."""
        self.on_moved: list[Callable[[WorkerEnv], None]] = []
        """Called with this worker's new place when a re-formation changed its rank (its
        process name, log prefix and metrics follow it)."""

    # ---- life cycle ------------------------------------------------------------------------
    def install(self) -> WorkerRuntime:
        """Turn SIGTERM into a stop request (only possible on the main thread)."""
        if self.preemption is not None and not self._installed \
                and threading.current_thread() is threading.main_thread():
            self.preemption.install()
            self._installed = True
        return self

    def start(self, *, total_steps: int | None, threads: int | None = None,
              config: Mapping[str, Any] | None = None) -> PreviousIncarnation | None:
        """Every rank: log this incarnation's start and the rendezvous that formed it.

        Returns the previous incarnation of this launch as the log tells it (rank 0 only).
        Raises ``CheckpointStopError`` when the agent restarted a job the save-failure
        policy stopped.
        """
        previous = (previous_incarnation(self.run_dir.gathered_events(), self.env.run_id)
                    if self.group.rank == 0 else None)
        self.events.emit(Start(run_id=self.env.run_id, restart=self.env.restart_count,
                               world_size=self.group.world_size, total_steps=total_steps,
                               backend=self.group.backend, threads=threads, config=config))
        if self.group.rank == 0:
            self._record_rendezvous(previous)
        self.save_failure.refuse_restart(previous, self.run_dir.checkpoints)
        self._previous = previous
        return previous

    def _record_rendezvous(self, previous: PreviousIncarnation | None) -> None:
        """The rendezvous that formed this world, and the resize if it is one.

        ``seconds`` is torch's agent's own measurement of the rendezvous when
        ``elastic-train run`` passed it on (rendezvous/timing.py), else null;
        ``since_last_step_seconds`` is the time since the previous world's last step (the
        failure or membership change, its detection, the rendezvous and this start-up);
        ``previous_last_step`` and ``previous_last_seen`` (its newest event's time) give the
        metrics the steps redone and the recovery time.
        """
        world = self.group.world_size
        since = None
        if previous is not None and previous.last_step_time is not None:
            since = round(time.time() - previous.last_step_time, 3)
        self.events.emit(Rendezvous(
            restart=self.env.restart_count, world_size=world, nodes=self.env.group_world_size,
            previous_world_size=previous.world_size if previous else None,
            previous_last_step=previous.last_step if previous else None,
            previous_last_seen=previous.last_seen if previous else None,
            seconds=self.env.rendezvous_seconds, since_last_step_seconds=since))
        if previous is not None and previous.world_size not in (None, world):
            self.events.emit(Resize(old_world_size=previous.world_size, new_world_size=world,
                                    nodes=self.env.group_world_size,
                                    restart=self.env.restart_count,
                                    since_last_step_seconds=since))

    def restore(self, objects: Mapping[str, Stateful]) -> Restored | None:
        """Every rank: load the newest valid checkpoint into ``objects`` (None: fresh run)."""
        restored = self.checkpoints.restore(dict(objects))
        if restored is not None and self.env.restart_count:
            self.events.emit(Restart(restart=self.env.restart_count, step=restored.step))
            previous = self._previous
            last = previous.last_step if previous is not None else None
            self.events.emit(Recovery(
                kind=RecoveryMode.RESTART, restart=self.env.restart_count, step=restored.step,
                world_size=self.group.world_size,
                previous_world_size=previous.world_size if previous else None,
                failed_ranks=None,
                steps_redone=max(0, last - restored.step) if last is not None else None,
                seconds=None, bytes=None))
        return restored

    # ---- live recovery -------------------------------------------------------------------
    def set_group(self, group: Group, env: WorkerEnv | None = None) -> None:
        """This worker's new process group (the world re-formed in place), and its new
        place in the job (``env``: rank, world and node may change with it). Rank 0 keeps
        the event log and writes the checkpoints, whichever process it is now."""
        moved = env is not None and env.rank != self.env.rank
        self.group = group
        if env is not None:
            self.env = env
        self.events.enabled = group.rank == 0
        self.checkpoints.group = group
        if self.live is not None:  # a sharded save's temp directory is this world's own
            self.checkpoints.generation = self.live.generation
        self.save_failure.group = group
        if moved:
            for callback in self.on_moved:
                callback(self.env)

    def failed_step(self, exc: BaseException) -> bool:
        """After a step failed with ``exc``: whether the world re-forms in place (a new
        generation announced: go to ``recover``), else the error is the worker's own. A
        failed collective may mean a lost peer: the agent is told at once and the
        announcement waited for (``ANNOUNCE_TIMEOUT``); any other error waits
        ``OWN_FAILURE_GRACE`` for a re-formation announced meanwhile, and says so."""
        if self.live is None:
            return False
        collective = aborts.is_collective_failure(exc)
        if collective:
            self.live.report_failed_collective()
        else:  # said: a peer's loss read as the loop's own error costs the grace
            print(f"rank {self.group.rank}: the step failed ({aborts.first_line(exc)}), not a "
                  f"collective: waits {OWN_FAILURE_GRACE:g} s for a re-formation", file=sys.stderr)
        return self.live.announced(None if collective else OWN_FAILURE_GRACE) is not None

    def recover(self, objects: Mapping[str, Stateful], first: Callable[[], Rejoined],
                step: int | None, sharded: ShardedLive | None = None) -> Rejoined:
        """Re-form the world in place (``first``: ``rejoin`` or ``arrive``), again as often
        as a member is lost meanwhile (a newer generation announced while the group forms
        or the state is sent); ``step``: the step this member's state is at, None before
        it received any. ``LiveRecoveryError`` and errors no announcement explains are
        raised (the agent then restarts the job from its newest checkpoint). ``sharded``: a
        sharded model's side (worker/sharded_recovery.py)."""
        assert self.live is not None
        attempt = first
        while True:
            try:
                return attempt()
            except LiveRecoveryError:
                raise
            except Exception:
                if self.live.announced() is None:
                    raise
            attempt = functools.partial(self.rejoin, objects, step=step, sharded=sharded)

    def rejoin(self, objects: Mapping[str, Stateful], *, step: int | None,
               attempted: int | None = None, failed_at: float | None = None,
               failed: bool | None = None, sharded: ShardedLive | None = None) -> Rejoined:
        """A member of a world that re-forms (a worker or a node was lost, or one joins):
        leave the old process group, meet every member of the new generation in a new one,
        and bring every member to the newest state.

        ``step``: the step this member's state is at (None: a worker started again that
        has not received it yet); ``attempted``: the step it was in when its collective
        failed (None: it left at a step boundary, or holds the step it failed after);
        ``failed``: whether a failure brought it here (default: ``attempted`` is given).
        ``sharded``: a sharded model's side, built again on the new group's mesh before
        the state is shared (worker/sharded_recovery.py).
        Raises ``LiveRecoveryError`` when the members do not all come back, none holds
        state, or no new generation is announced (a boundary vote whose agent never
        tells); the worker then fails and the agent restarts the job from disk.
        """
        assert self.live is not None
        previous_world = self.group.world_size
        if self.live.announced() is None:
            raise LiveRecoveryError("the world was to re-form but this worker's agent "
                                    "announced no new generation; the job restarts from its "
                                    "newest checkpoint")
        aborts.abandon_group()
        self.checkpoints.reformed()
        self.set_group(self.live.join(), self.live.env)
        failed = attempted is not None if failed is None else failed
        marks = {"failed_at" if failed else "paused_at": failed_at or time.time(),
                 "joined_at": time.time()}
        if sharded is not None:  # FSDP2 keeps its mesh's group: build it on the new one
            objects = sharded.rebuild()
            marks["rebuilt_at"] = time.time()
        return self._share_and_report(objects, step, attempted, previous_world, marks,
                                      sharded)

    def join_arriving(self) -> Group:
        """A worker started into a running world, built: join it (``arrive`` does, unless
        this came first: a loop that wraps its model in DDP before it restores)."""
        assert self.live is not None
        if self._joined_at is None:
            self.live.ready_to_join()
            self.set_group(self.live.join(), self.live.env)
            self._joined_at = time.time()
        return self.group

    def arrive(self, objects: Mapping[str, Stateful], started_at: float | None = None,
               sharded: ShardedLive | None = None) -> Rejoined:
        """A worker started into a running world: join it, receive the newest state from
        one of its members (``sharded``: a sharded model, built on this world's mesh)."""
        self.join_arriving()
        assert self._joined_at is not None
        marks = {"process_start": started_at or time.time(), "joined_at": self._joined_at}
        return self._share_and_report(objects, None, None, self.group.world_size, marks,
                                      sharded)

    def _share_and_report(self, objects: Mapping[str, Stateful], step: int | None,
                          attempted: int | None, previous_world: int,
                          marks: dict[str, float], sharded: ShardedLive | None = None
                          ) -> Rejoined:
        assert self.live is not None
        generation = self.live.generation
        rejoined = self.share_state(objects, step=step, attempted=attempted, sharded=sharded)
        marks["state_at"] = time.time()
        failure = self.live.failure(generation)
        if failure.detected_at is not None:
            marks["detected_at"] = failure.detected_at
        since = time.time() - failure.detected_at if failure.detected_at else None
        world = self.group.world_size
        # the plan knows the world before (an arriving worker was in none)
        previous_world = self.live.plan.previous_world_size or previous_world
        self.events.emit(Recovery(
            kind=RecoveryMode.LIVE, restart=self.env.restart_count, step=rejoined.step,
            world_size=world, previous_world_size=previous_world,
            failed_ranks=failure.ranks, steps_redone=rejoined.steps_redone,
            seconds=round(since, 3) if since is not None else None, bytes=rejoined.bytes,
            generation=generation, source_rank=rejoined.source_rank, cause=failure.cause,
            lost_nodes=failure.lost_nodes or None,
            state_from="checkpoint" if rejoined.from_checkpoint else "peers",
            marks={k: round(v, 6) for k, v in marks.items()}))
        if previous_world and previous_world != world:
            self.events.emit(Resize(old_world_size=previous_world, new_world_size=world,
                                    nodes=self.env.group_world_size,
                                    restart=self.env.restart_count,
                                    since_last_step_seconds=None))
        if self.group.rank == 0:
            self.say(_recovery_line(failure, previous_world, world, generation, rejoined))
        return rejoined

    def share_state(self, objects: Mapping[str, Stateful], *, step: int | None,
                    attempted: int | None = None, sharded: ShardedLive | None = None
                    ) -> Rejoined:
        """Every member: the lowest rank holding the newest step sends its state to every
        member behind it (one all-reduce of the steps, one broadcast of the state). A
        sharded model's parts come from whoever holds them, else from the newest
        checkpoint (worker/sharded_recovery.py)."""
        world, rank = self.group.world_size, self.group.rank
        # [steps held, steps attempted, writer epochs], each +1 so that 0 means none
        tally = torch.zeros(3 * world, dtype=torch.float64, device=self.group.device)
        tally[rank] = 0 if step is None else step + 1
        tally[world + rank] = 0 if attempted is None else attempted + 1
        epoch = self.checkpoints.epoch
        tally[2 * world + rank] = 0 if epoch is None else epoch + 1
        values = [int(v) - 1 for v in distributed.sum_over_ranks(self.group, tally)]
        held, tried = values[:world], values[world:2 * world]
        if max(values[2 * world:]) >= 0:  # the world keeps its epoch: a new member learns it
            self.checkpoints.join_epoch(max(values[2 * world:]))
        newest = max(held)
        if newest < 0:
            raise LiveRecoveryError("no worker of the re-formed world holds the training "
                                    "state; the job restarts from its newest checkpoint")
        redone = 1 if max(tried) > newest else 0
        if sharded is not None:
            shared = sharded_recovery.share(
                self.group, objects, sharded.holding, held, newest,
                restore=lambda: self.checkpoints.restore(dict(objects)))
            rejoined = Rejoined(self.group, shared.step, redone + newest - shared.step,
                                shared.bytes, shared.source_rank, shared.from_checkpoint)
        else:
            source = held.index(newest)
            behind = [r for r, h in enumerate(held) if h < newest]
            sent = 0
            if behind:
                states = {name: obj.state_dict() for name, obj in objects.items()} \
                    if rank == source else None
                received, sent = distributed.broadcast_state(self.group, states, source)
                if rank in behind:
                    assert received is not None
                    for name, obj in objects.items():
                        obj.load_state_dict(received[name])
            rejoined = Rejoined(self.group, newest, redone, sent, source)
        fence = self.checkpoints.fence
        if self.live is not None and self.live.plan.claim_epoch and fence is not None \
                and not rejoined.from_checkpoint:  # a restore claims one itself
            # The writer of the world before is not in this one (a lost node, or one cut
            # off): a new epoch fences whatever it may still commit (checkpoint/fence.py),
            # from the step the world goes on from.
            if rank == 0:
                self.checkpoints.epoch = fence.claim(rejoined.step, self.env.run_id)
            if sharded is not None:  # every rank names its shards' directory by it
                self.checkpoints.join_epoch(
                    distributed.broadcast_json(self.group, self.checkpoints.epoch))
        return rejoined

    # ---- the step watchdog ---------------------------------------------------------------
    def step_watchdog(self, step_timeout: float | None) -> StepWatchdog | NoWatchdog:
        """A watchdog for this world (not started): a rank whose loop completes no step
        for ``step_timeout`` seconds is named, killed when it runs on this host, and
        recorded as a ``hang`` event (worker/watchdog.py). Under live recovery the agent starts
        it again and the world re-forms in place; else this worker fails and the job
        restarts from its newest checkpoint. None: no watchdog."""
        if step_timeout is None:
            return NoWatchdog()
        events_file = self.run_dir.events
        restart = self.env.restart_count
        publisher = self.publisher

        def report(finding: dict[str, Any]) -> None:
            # Any rank may find the hang (rank 0 may be the stuck one): append directly.
            log_ = EventLog(events_file)
            log_.emit(Hang(restart=restart,
                           finding={k: v for k, v in finding.items() if k != "message"}))
            log_.close()
            publisher.track(events_file)
            publisher.publish_now()
            print(f"elastic_train: error: {finding['message']}", file=sys.stderr, flush=True)

        store = distributed.default_store() if self.group.world_size > 1 else None
        return StepWatchdog(store, self.group.rank, self.group.world_size, step_timeout,
                            report, replaces_killed=self.live is not None)

    def hold_state(self) -> None:
        """This worker holds the training state now (restored, or received): from here a
        SIGTERM stops it at a step boundary with a checkpoint; before, it exits at once
        (worker/preemption.py)."""
        if self.preemption is not None:
            self.preemption.arm()

    # ---- the step boundary ---------------------------------------------------------------
    @property
    def votes_needed(self) -> bool:
        """Whether anything but the loss can end the loop (else a loop without a loss to
        reduce may skip the vote)."""
        return self.preemption is not None or self.save_failure.enabled \
            or self.checkpoints.policy.every_seconds is not None

    def vote(self, loss_sum: torch.Tensor | float | None = None, step: int | None = None
             ) -> Vote:
        """Every rank, after each optimizer step: what all ranks agree on (one all-reduce).

        ``loss_sum`` (this rank's, a tensor on the group's device avoids a sync) is summed
        with the rest; without it and with nothing that can stop the loop, no collective
        is made.
        """
        if self.preemption is not None and not self.preemption.armed:
            self.preemption.arm()  # a loop that never restored: it trains, so it holds it
        pre = self.preemption
        preempted = pre is not None and pre.preempted
        by_agent = pre is not None and pre.by_agent is not None
        save_failed = self.save_failure.vote()
        reform = self.live is not None and self.live.reform_due
        if loss_sum is None and (self.group.world_size == 1 or not self.votes_needed):
            # No collective: rank 0's reason to stop (a fenced write) cannot reach the
            # others, so it must not end rank 0's loop alone (the final save reports it).
            alone = save_failed and self.group.world_size == 1
            vote = Vote(loss_sum=0.0, stop=preempted or by_agent, save_failed=alone,
                        stopped_nodes=(self.env.group_rank,) if preempted else (),
                        reform=reform and self.group.world_size == 1, restart=by_agent,
                        save_due=self.checkpoints.interval_passed()
                        if self.group.world_size == 1 else None)
        else:
            nodes, checks = self.env.group_world_size, self.stragglers
            tally = make_tally(nodes, checks.slots(self.group.world_size), self.group.device,
                               loss_sum=loss_sum, preempted=preempted, by_agent=by_agent,
                               ripe=preempted and pre is not None
                               and pre.seconds_since() >= LEAVE_GRACE,
                               save_failed=save_failed, reform=reform, node=self.env.group_rank,
                               save_due=self.group.rank == 0
                               and self.checkpoints.interval_passed())
            checks.put(tally, TALLY_NODES + nodes, self.group.rank)
            summed = torch.as_tensor(distributed.sum_over_ranks(self.group, tally)).tolist()
            checks.read(summed, TALLY_NODES + nodes, self.group, step or 0)
            vote = decide(summed[:TALLY_NODES + nodes], self.env.group_rank, nodes,
                          live=self.live is not None)
        if vote.stop:
            self.stopped_nodes = vote.stopped_nodes
            self.restarting = vote.restart
        if vote.leaving and not vote.leave and self.live is not None:
            # the agents re-form without them (not called, not waited for)
            self.live.report_leaving(vote.leaving)
        return vote

    def save_if_due(self, step: int, objects: Mapping[str, Stateful],
                    overlap_with: torch.optim.Optimizer | None = None,
                    vote: Vote | None = None) -> None:
        """Between steps: a periodic checkpoint when the policy says one is due (the
        checkpoint interval as the step's ``vote`` agreed it, where it was voted on).

        ``overlap_with``: the optimizer, when it alone changes the state (then the state's
        copy overlaps the next forward and backward).
        """
        due = self.checkpoints.due(step, vote.save_due if vote is not None else None)
        if self.replicas is not None and self.replicas.due(step, saving=due):
            self.replicas.check(self.group, step, objects)  # raises: nothing corrupt is saved
        if due:
            self.checkpoints.save(step, dict(objects), overlap_with=overlap_with)

    def end(self, step: int, objects: Mapping[str, Stateful], vote: Vote = GO_ON, *,
            then: Callable[[], None] | None = None) -> None:
        """Every rank, after the loop: the end of the protocol for this incarnation.

        A save-failure stop raises ``CheckpointStopError`` (the same line on every rank; the
        last good checkpoint stays). Otherwise the preemption or final checkpoint of
        ``step`` is written and waited for (none when ``objects`` is empty); ``then`` runs
        on rank 0 after a final one (an export of the weights); every rank waits for the
        others, and the ``end`` event marks a run that is over.
        """
        if self.live is not None:
            self.live.finished()
        if vote.leave:  # this node alone: the others hold the state and go on without it
            self.stopped_at, self.left = step, True
            if self.live is not None:
                self.live.left(step)
            if objects:
                self.checkpoints.finish()  # a save in flight ends (committed or given up)
            return
        if vote.save_failed or self.save_failure.agreed_after_loop():
            self.save_failure.stop(step)
        if vote.stop:
            self.stopped_at = step
        if vote.stop and not vote.restart:
            fields = self.preemption.event_fields() if self.preemption is not None else {}
            self.events.emit(Preempted(step=step, signal=fields.get("signal"),
                                       rank_signalled=bool(fields.get("rank_signalled")),
                                       seconds_since_signal=fields.get("seconds_since_signal")))
        if objects:  # else nothing was registered to checkpoint (a loop without restore)
            reason = ("restart" if vote.restart else "preemption") if vote.stop else "final"
            if self.replicas is not None and self.replicas.due(step, saving=True):
                self.replicas.check(self.group, step, objects)
            self.checkpoints.save(step, dict(objects), reason=reason, wait=True)
            self.checkpoints.finish()
        if then is not None and not vote.stop and self.group.rank == 0:
            then()
        distributed.barrier(self.group)
        if vote.stop:
            if self.group.rank == 0 and vote.restart:
                self.say(f"an agent restarts its workers: every rank stopped at step {step} "
                         "with a checkpoint, and starts again from it (not a preemption)")
            elif self.group.rank == 0:
                self.say(f"stop requested (preemption): stopped at step {step} with a "
                         "checkpoint; rerun the same command to resume")
        else:
            # A stop on SIGTERM is no end: the agent also sends it to re-form the world
            # (a node joined) and the launch goes on; its "preempted" event says enough.
            self.events.emit(End(step=step, run_id=self.env.run_id))

    def close(self) -> None:
        """Give SIGTERM back and close the event log (on every path out, errors included)."""
        if self._installed and self.preemption is not None:
            self.preemption.uninstall()
            self._installed = False
        if self.live is not None:
            self.live.close()
        self.events.close()
        self.publisher.close()

    def raise_if_node_stopped(self) -> None:
        """After a stop: a node whose workers got no signal, and every worker stopped for an
        agent's restart, raises ``NodeStoppedError`` (never an exit that reads as the job's
        end); a node that left alone raises ``NodeLeftAloneError`` (exit 143)."""
        if self.stopped_at is None:
            return
        if self.left:
            signal_name = self.preemption.signal_name if self.preemption is not None else None
            raise NodeLeftAloneError(
                f"this node was stopped alone ({signal_name or 'a signal'}): it left the job "
                f"at step {self.stopped_at}, and the other nodes go on without it")
        if self.restarting:
            raise NodeStoppedError(
                f"stopped at step {self.stopped_at} with a checkpoint: an agent restarts its "
                "workers from it (torch's restart path); this node's agent starts its "
                "workers again too")
        if self.env.group_rank not in self.stopped_nodes:
            raise node_stopped(list(self.stopped_nodes), self.stopped_at)


def _recovery_line(failure: LostMembers, before: int, after: int, generation: int,
                   rejoined: Rejoined) -> str:
    """What rank 0 says about a live recovery."""
    state = (f"at step {rejoined.step}: {rejoined.bytes} bytes of state sent, "
             f"{rejoined.steps_redone} step redone")
    if rejoined.from_checkpoint:
        state = (f"from the newest checkpoint, at step {rejoined.step} (no member held the "
                 f"lost shards; {rejoined.steps_redone} steps redone)")
    ranks = ", ".join(map(str, failure.ranks))
    if failure.cause == "node joined":
        return (f"live recovery: a node joined, the world grew in place from {before} to "
                f"{after} workers (generation {generation}) {state}")
    if failure.lost_nodes:
        return (f"live recovery: {failure.lost_nodes} node(s) lost (ranks {ranks}), the "
                f"world re-formed in place from {before} to {after} workers (generation "
                f"{generation}) {state}")
    if failure.ranks:
        return (f"live recovery: rank {ranks} started again, the world of {after} re-formed "
                f"in place (generation {generation}) {state}")
    change = f"from {before} to {after} workers" if before != after else f"of {after}"
    return (f"live recovery: the world {change} re-formed in place "
            f"({failure.cause or 'new round'}, generation {generation}) {state}")
