"""The event log's schema: every event's name and fields, in one place.

The event log (events/log.py) is the bus between the worker and what reads a run: metrics,
progress, the end-of-run summary, reports. Emitters build one of the records below and hand
it to ``EventLog.emit``; readers get plain dicts back from the file (older logs may lack
newer fields: read them with ``.get``) and compare ``record["event"]`` with ``Event``.

Each record holds the fields its event writes, and only those; a field listed in a class's
``omitted_when_none`` is left out of the line when it is None (an optional part, e.g. the
trainer's extra step fields that a hand-written loop does not have).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar


class Event(StrEnum):
    """Every event name the log holds (a ``str``: it compares equal to the name read back)."""

    START = "start"
    RENDEZVOUS = "rendezvous"
    RESIZE = "resize"
    BATCH_PLAN = "batch_plan"
    RESTART = "restart"
    RECOVERY = "recovery"
    STARTUP = "startup"
    STEP = "step"
    PREEMPTED = "preempted"
    STOPPED = "stopped"
    HANG = "hang"
    REPLICAS_DIVERGED = "replicas_diverged"
    STRAGGLER = "straggler"
    END = "end"
    CHECKPOINT_LEFTOVER_REMOVED = "checkpoint_leftover_removed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_WAITED = "checkpoint_waited"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_FENCED = "checkpoint_fenced"
    CHECKPOINT_DELETED = "checkpoint_deleted"


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    """Base of every record: its ``event`` name and how its fields become a line."""

    event: ClassVar[Event]
    omitted_when_none: ClassVar[frozenset[str]] = frozenset()
    flattened: ClassVar[frozenset[str]] = frozenset()
    """Mapping fields whose items are written as fields of their own."""

    def fields(self) -> dict[str, Any]:
        """The record's fields in the order the class declares them, as written to the log."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.flattened:
                clash = set(value) & set(out)
                if clash:  # a mark or finding named like a declared field would replace it
                    raise ValueError(f"{type(self).__name__}.{f.name} repeats {sorted(clash)}")
                out.update(value)
            elif value is not None or f.name not in self.omitted_when_none:
                out[f.name] = value
        return out


# ---- the run and its incarnations ------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Start(EventRecord):
    """A worker group began (every incarnation); ``total_steps`` None: a hand-written loop."""

    event: ClassVar[Event] = Event.START
    omitted_when_none: ClassVar[frozenset[str]] = frozenset({"threads", "config"})
    run_id: str
    restart: int
    world_size: int
    total_steps: int | None
    backend: str
    threads: int | None = None
    config: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Rendezvous(EventRecord):
    """The rendezvous that formed this world; ``previous_*`` describe the world before."""

    event: ClassVar[Event] = Event.RENDEZVOUS
    restart: int
    world_size: int
    nodes: int
    previous_world_size: int | None
    previous_last_step: int | None
    previous_last_seen: float | None
    seconds: float | None
    since_last_step_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class Resize(EventRecord):
    """The world size changed from the previous incarnation's."""

    event: ClassVar[Event] = Event.RESIZE
    old_world_size: int
    new_world_size: int
    nodes: int
    restart: int
    since_last_step_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class BatchPlan(EventRecord):
    """The built-in trainer's global batch and LR scale for this world size."""

    event: ClassVar[Event] = Event.BATCH_PLAN
    policy: str
    global_batch: int
    lr_scale: float
    lr: float
    step: int
    world_size: int
    reference_world_size: int


@dataclass(frozen=True, kw_only=True)
class Restart(EventRecord):
    """A restarted incarnation resumed from a checkpoint of ``step``."""

    event: ClassVar[Event] = Event.RESTART
    restart: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Recovery(EventRecord):
    """The world re-formed after a failure: ``kind`` live (in place, state from a peer) or
    restart (every worker started again from the newest checkpoint).

    ``failed_ranks``: the workers the agent started again (live); ``step``: the step the
    world goes on from; ``steps_redone``: steps whose work was lost (the step in flight on a
    live recovery; the steps after the checkpoint on a restart); ``seconds``: from the
    agent's detection of the failure to the state in place on every rank (live), or null;
    ``bytes``: the state sent between workers (live) or read from disk (restart);
    ``cause`` (live): worker lost, node lost, node joined, collective failed, new round;
    ``lost_nodes`` (live): agents of the world before that are not in this one;
    ``state_from`` (live): ``peers`` (the state was sent by members holding it) or
    ``checkpoint`` (a sharded model whose parts the members did not all hold: every member
    loaded the newest checkpoint, in its running process).
    """

    event: ClassVar[Event] = Event.RECOVERY
    omitted_when_none: ClassVar[frozenset[str]] = frozenset({"generation", "source_rank",
                                                             "cause", "lost_nodes",
                                                             "state_from"})
    flattened: ClassVar[frozenset[str]] = frozenset({"marks"})
    kind: str
    restart: int
    step: int
    world_size: int
    previous_world_size: int | None
    failed_ranks: list[int] | None
    steps_redone: int | None
    seconds: float | None
    bytes: int | None
    generation: int | None = None
    source_rank: int | None = None
    cause: str | None = None
    lost_nodes: int | None = None
    state_from: str | None = None
    marks: Mapping[str, float] = field(default_factory=dict)
    """Live: Unix times on rank 0 of ``detected_at`` (the agent), ``failed_at`` (its step
    failed) or ``paused_at`` (it left its loop at a step boundary; a started-again rank 0:
    ``process_start``), ``joined_at`` (new group formed) and ``state_at`` (every rank holds
    the newest state)."""


@dataclass(frozen=True, kw_only=True)
class Startup(EventRecord):
    """The start-up timeline of an incarnation (wall-clock marks), at its first step."""

    event: ClassVar[Event] = Event.STARTUP
    flattened: ClassVar[frozenset[str]] = frozenset({"marks"})
    restart: int
    resumed_step: int
    first_step_done: float
    marks: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Step(EventRecord):
    """One optimizer step done; the trainer adds the fields a hand-written loop lacks."""

    event: ClassVar[Event] = Event.STEP
    omitted_when_none: ClassVar[frozenset[str]] = frozenset(
        {"lr", "epoch", "samples", "global_batch", "seconds", "compute_seconds",
         "straggler_score"})
    step: int
    loss: float | None
    lr: float | None = None
    epoch: int | None = None
    world_size: int
    samples: int | None = None
    global_batch: int | None = None
    seconds: float | None = None
    compute_seconds: float | None = None
    """This rank's local part of the step (--straggler-policy: worker/straggler_check.py)."""
    straggler_score: float | None = None
    """This rank's compute over the others' median, at this step."""
    restart: int


@dataclass(frozen=True, kw_only=True)
class Preempted(EventRecord):
    """The job stops at ``step`` on a SIGTERM/SIGINT that some rank received."""

    event: ClassVar[Event] = Event.PREEMPTED
    step: int
    signal: str | None
    rank_signalled: bool
    seconds_since_signal: float | None


@dataclass(frozen=True, kw_only=True)
class Stopped(EventRecord):
    """The job stopped on purpose (``reason``: checkpoint_failed) and must not restart."""

    event: ClassVar[Event] = Event.STOPPED
    reason: str
    step: int | None
    failed_step: int | None
    error: str | None
    last_good_step: int | None
    restart: int


@dataclass(frozen=True, kw_only=True)
class Hang(EventRecord):
    """The step watchdog found no progress for --step-timeout and fails this worker."""

    event: ClassVar[Event] = Event.HANG
    flattened: ClassVar[frozenset[str]] = frozenset({"finding"})
    restart: int
    finding: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ReplicasDiverged(EventRecord):
    """The replicas' fingerprints differed after ``step`` (silent data corruption):
    ``named`` the ranks a strict majority of their replicas outvoted, ``suspects`` every
    rank that may hold the corrupt state (all of a group without a majority), ``nodes``
    each suspect's host (in the order of ``suspects``); the job restarts from its newest
    checkpoint."""

    event: ClassVar[Event] = Event.REPLICAS_DIVERGED
    step: int
    named: list[int]
    suspects: list[int]
    nodes: list[str]
    replicas: int


@dataclass(frozen=True, kw_only=True)
class Straggler(EventRecord):
    """``rank`` (on host ``node``) computed slower than its peers: the median of its scores
    (its compute time over the others' median) over the last ``window`` steps was
    ``score``, above ``factor``. Said once per streak; ``policy`` says what follows."""

    event: ClassVar[Event] = Event.STRAGGLER
    step: int
    rank: int
    node: str
    score: float
    compute_seconds: float
    others_seconds: float
    factor: float
    window: int
    policy: str


@dataclass(frozen=True, kw_only=True)
class End(EventRecord):
    """The run reached its end (not written on a stop: the launch may go on)."""

    event: ClassVar[Event] = Event.END
    step: int
    run_id: str


# ---- checkpoints -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CheckpointLeftoverRemoved(EventRecord):
    """A temporary directory of an interrupted save was removed."""

    event: ClassVar[Event] = Event.CHECKPOINT_LEFTOVER_REMOVED
    path: str


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(EventRecord):
    """A checkpoint failed verification at restore and was passed over."""

    event: ClassVar[Event] = Event.CHECKPOINT_SKIPPED
    step: int
    path: str
    problem: str | None


@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded(EventRecord):
    """Every rank loaded this checkpoint."""

    event: ClassVar[Event] = Event.CHECKPOINT_LOADED
    step: int
    path: str
    model_digest: str | None
    saved_world_size: int | None
    saved_time: float | None
    world_size: int
    seconds: float
    source: str = "storage"
    """``storage`` (the run directory) or ``memory`` (the agents' memory tier)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(EventRecord):
    """A checkpoint is durable; ``copy_*`` only when its copy overlapped the next step."""

    event: ClassVar[Event] = Event.CHECKPOINT_SAVED
    omitted_when_none: ClassVar[frozenset[str]] = frozenset({"copy_seconds",
                                                             "copy_wait_seconds",
                                                             "memory_copies",
                                                             "memory_seconds",
                                                             "uploaded_by"})
    step: int
    path: str
    reason: str
    bytes: int
    model_digest: str | None
    snapshot_at: float
    snapshot_seconds: float
    copy_seconds: float | None = None
    copy_wait_seconds: float | None = None
    persist_seconds: float
    persist_cpu_seconds: float
    waited_seconds: float
    memory_copies: int | None = None
    """Agents' memory holding it (the memory tier; None: no tier)."""
    memory_seconds: float | None = None
    """From the persist's start until the memory copies were held."""
    uploaded_by: str | None = None
    """Who uploaded the payload to an object store: ``agent`` (its holder, written behind
    the memory tier) or ``worker``; None on a filesystem."""


@dataclass(frozen=True, kw_only=True)
class CheckpointWaited(EventRecord):
    """A save waited for the previous one's persist to finish."""

    event: ClassVar[Event] = Event.CHECKPOINT_WAITED
    seconds: float
    step: int | None


@dataclass(frozen=True, kw_only=True)
class CheckpointFenced(EventRecord):
    """A checkpoint was not committed: writer epoch ``newer_epoch`` (a newer world) owns
    the run's checkpoints; this world (``epoch``) stops."""

    event: ClassVar[Event] = Event.CHECKPOINT_FENCED
    step: int
    epoch: int
    newer_epoch: int


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(EventRecord):
    """A checkpoint could not be written; ``policy`` is --on-save-failure."""

    event: ClassVar[Event] = Event.CHECKPOINT_FAILED
    step: int
    error: str
    policy: str


@dataclass(frozen=True, kw_only=True)
class CheckpointDeleted(EventRecord):
    """A checkpoint was deleted (``reason``: retention)."""

    event: ClassVar[Event] = Event.CHECKPOINT_DELETED
    path: str
    reason: str
