"""``--on-save-failure stop``: every rank stops together when rank 0 cannot write a checkpoint.

Rank 0's failed write (checkpoint/manager.py keeps it in ``failed``) becomes a vote folded
into the all-reduce every step already does (worker/runtime.py), like the preemption stop
(worker/preemption.py): all ranks leave the loop at the same step boundary. No checkpoint is
attempted then (the disk just failed one); the last good one stays. Every rank raises the
same one-line ``CheckpointStopError`` (rank 0's message, broadcast), which only rank 0
prints.

torch's agent restarts failed workers. A worker it restarts after such a stop, within the
same launch, refuses to train on (the event log's ``stopped`` record says why), so the
launch ends after its restarts instead of filling the disk again; a new launch of the same
command resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_train.checkpoint.manager import CheckpointManager
from elastic_train.errors import CheckpointStopError, StaleWorldError
from elastic_train.events.log import EventLog, PreviousIncarnation
from elastic_train.events.schema import Stopped
from elastic_train.worker import distributed
from elastic_train.worker.distributed import Group


def stop_message(step: Any, failed_step: Any, root: Any, reason: Any, last_good: Any,
                 option: str = "--on-save-failure") -> str:
    """The one line of a job stopped by ``--on-save-failure stop`` (``option``: how the
    user set the policy)."""
    resume = (f"resumes from checkpoint {last_good}, which is intact" if last_good is not None
              else "starts from scratch: no checkpoint was written")
    return (f"stopped at step {step}: checkpoint {failed_step} could not be written under "
            f"{root} ({reason}) and {option} is stop: free space or fix permissions, "
            f"then rerun the same command (it {resume})")


class SaveFailureStop:
    """The ``stop`` policy of one worker; inert under ``continue``."""

    def __init__(self, checkpoints: CheckpointManager, group: Group, events: EventLog,
                 restart_count: int, option: str = "--on-save-failure") -> None:
        self.enabled = checkpoints.policy.on_save_failure == "stop"
        self.checkpoints = checkpoints
        self.group = group
        self.events = events
        self.restart_count = restart_count
        self.option = option

    def vote(self) -> bool:
        """This rank's vote to stop now (only rank 0 writes checkpoints): a failed write
        under the stop policy, or a fenced one under any policy (fence.py)."""
        return (self.enabled and self.checkpoints.failed is not None) \
            or self.checkpoints.fenced is not None

    def agreed_after_loop(self) -> bool:
        """After the last step: whether rank 0's last periodic write failed (then no final
        checkpoint is attempted). A collective, under the ``stop`` policy only."""
        if not self.enabled:
            return False
        self.checkpoints.finish()  # the last periodic persist's outcome
        return bool(distributed.broadcast_json(self.group,
                                               self.vote() if self.group.rank == 0 else None))

    def stop(self, step: int) -> None:
        """Every rank: log the stop (rank 0) and raise the same line."""
        message = None
        if self.group.rank == 0:
            self.checkpoints.finish()
            fenced = self.checkpoints.fenced
            if fenced is not None:  # a stale world: its agent rejoins, no 'stopped' record
                message = ["fenced", f"stopped at step {step}: {fenced}"]
            else:
                failure = self.checkpoints.failed
                assert failure is not None
                last_good = self.checkpoints.last_saved_step
                message = ["failed", stop_message(step, failure.step, failure.root,
                                                  failure.reason, last_good, self.option)]
                self._record(step, failure.step, failure.reason, last_good)
        kind, line = distributed.broadcast_json(self.group, message)
        raise (StaleWorldError if kind == "fenced" else CheckpointStopError)(line)

    def refuse_restart(self, previous: PreviousIncarnation | None, root: Path) -> None:
        """Every rank, at start: fail at once if the agent restarted us after such a stop."""
        if not self.enabled:
            return
        message = None
        if self.group.rank == 0 and self.restart_count > 0 and previous is not None \
                and previous.stopped is not None:
            was = previous.stopped
            message = "not restarting: " + stop_message(
                was.get("step"), was.get("failed_step"), root, was.get("error"),
                was.get("last_good_step"), self.option)
            self._record(was.get("step"), was.get("failed_step"), was.get("error"),
                         was.get("last_good_step"))
        message = distributed.broadcast_json(self.group, message)
        if message is not None:
            raise CheckpointStopError(message)

    def _record(self, step: Any, failed_step: Any, error: Any, last_good: Any) -> None:
        self.events.emit(Stopped(reason="checkpoint_failed", step=step, failed_step=failed_step,
                                 error=error, last_good_step=last_good,
                                 restart=self.restart_count))
