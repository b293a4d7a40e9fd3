"""Exception types of elastic_train.

Every message says what is wrong and what to do about it, in one line, so that the
console command can print it as is and exit non-zero.
"""

from __future__ import annotations


class ElasticTrainError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code: int = 1


class ConfigError(ElasticTrainError):
    """A job option, config file or task option is missing, unknown or out of range."""

    exit_code = 2


class TaskError(ElasticTrainError):
    """A task cannot be imported or built, or breaks the Task protocol."""

    exit_code = 2


class CheckpointError(ElasticTrainError):
    """A checkpoint cannot be written, read or used."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions); the ones on disk stay."""

    def __init__(self, step: int, root: object, reason: str) -> None:
        self.step = step
        self.root = root
        self.reason = reason
        super().__init__(f"could not write checkpoint {step} under {root} ({reason}): free "
                         "space or fix permissions; the previous checkpoints are intact")


class CheckpointFencedError(CheckpointError):
    """A checkpoint was not committed: a newer world owns this run's checkpoints
    (checkpoint/fence.py); this world is stale and stops without writing."""

    reported_by_rank0 = True

    def __init__(self, step: int, epoch: int, newer_epoch: int, newer: str) -> None:
        self.step = step
        self.epoch = epoch
        self.newer_epoch = newer_epoch
        super().__init__(
            f"checkpoint {step} was not committed: a newer world owns this run's checkpoints "
            f"({newer}) and this world (writer epoch {epoch}) is no longer part of the job "
            "(cut off by a partition, or its agents already moved on): it stops without "
            "writing, and its agent rejoins the job's rendezvous")


class StaleWorldError(CheckpointError):
    """Every rank of a world whose checkpoint was fenced stops with rank 0's line."""

    reported_by_rank0 = True


class CheckpointStopError(CheckpointError):
    """The job stopped: a checkpoint could not be written and ``--on-save-failure stop``.

    Every rank raises it with rank 0's message; only rank 0 prints it (one line).
    """

    reported_by_rank0 = True


class NodeStoppedError(ElasticTrainError):
    """Another node was stopped (preempted): this node's workers checkpointed with it at the
    same step and exit so that their agent re-forms the world without that node.

    A plain exit 0 would tell torch's agent that training is done: it would close the
    rendezvous, and the training operator would mark the whole job succeeded.
    """

    exit_code = 75  # EX_TEMPFAIL: the agent restarts the workers


class NodeLeftAloneError(NodeStoppedError):
    """This node was signalled alone (a spot node reclaimed, a node drained): its workers
    left the job at a step boundary while the others go on. Exit 143, as a process ended by
    SIGTERM: never 0, which an agent that was not signalled itself (a worker signalled
    directly) would read as the job done."""

    exit_code = 143


class NodeLeftError(ElasticTrainError):
    """This node's agent cannot go on in the job (its restarts are spent while the others
    train on, or the rendezvous closed while it waited to join): it leaves with this line
    and a non-zero exit, never as if the job were done (on Kubernetes a pod that exits 0 is
    "Completed" and never restarted)."""


class MemoryTierError(CheckpointError):
    """The memory tier (the agents' snapshot holders, worker/memory_tier.py) could not take
    or give a snapshot: the caller goes on with the durable store."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (torn write, bit rot, edits)."""


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint belongs to another model or format: refusing it keeps it intact."""

    exit_code = 3


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint payload holds objects that `weights_only` loading refuses to execute."""

    exit_code = 3


class MetricsError(ElasticTrainError):
    """The metrics endpoint cannot be served (port in use, unsupported exporter mode)."""

    exit_code = 2


class ReportError(ElasticTrainError):
    """A run report cannot be made (no event log, no run in it, matplotlib missing)."""

    exit_code = 2


class DistributedError(ElasticTrainError):
    """The process group cannot be formed or a collective timed out."""


class RendezvousConfigError(ConfigError, ValueError):
    """A rendezvous option (--rdzv-endpoint, --rdzv-conf) cannot work.

    Also a ValueError, which is what torch's launcher expects from a handler's creator.
    """


class RendezvousUnavailableError(ElasticTrainError):
    """The rendezvous service cannot be reached or lacks what the chosen backend needs."""


class LiveRecoveryError(DistributedError):
    """The world could not re-form in place (no worker holds the state, a member did not
    come back in time): the worker fails, and the agent's restart path takes over."""


class NetworkConfigError(ConfigError):
    """The workers of a job across hosts would advertise an address other hosts cannot
    reach (network.py): refused before any worker starts."""


class RendezvousStoreLostError(ElasticTrainError):
    """The c10d rendezvous' store (in one node's agent) stopped answering: the job cannot
    re-form without it."""


class RoundMemberLostError(ElasticTrainError):
    """A member of a closed rendezvous round did not take its worker ranks in time, or its
    rank 0 committed no plan for the round (lost right after the round closed): the agent
    goes into the next round without it (agent/round_ranks.py, live/coordination.py)."""

    def __init__(self, missing: list[int], members: int, seconds: float,
                 task: str = "take their worker ranks") -> None:
        self.missing = list(missing)
        """The members' ranks in the round (known to its rank 0, and to every member when
        rank 0 is the one missing; empty elsewhere)."""
        super().__init__(
            f"member(s) {self.missing} of a rendezvous round of {members} did not {task} "
            f"within {seconds:g} s (lost right after the round closed)"
            if self.missing else
            f"the rendezvous round of {members} did not assign this node's worker ranks "
            f"within {seconds:g} s (a member was lost right after the round closed)"
            if task == "take their worker ranks" else
            f"a member of the rendezvous round of {members} did not {task} within "
            f"{seconds:g} s (lost right after the round closed)")


class StorageError(ElasticTrainError):
    """The object store a run directory names failed an operation (checkpoint/object_store.py)."""


class StorageUnavailableError(StorageError):
    """The object store did not answer (down, unreachable, timed out)."""


class StorageRefusedError(StorageError):
    """The object store answered no: a missing bucket, refused credentials or permissions."""

    exit_code = 2


class ReplicaDivergenceError(ElasticTrainError):
    """Replicas that must hold the same state do not (silent data corruption: a flipped bit
    in weights or optimizer state, a wrong result of a kernel): the step's state is not
    trusted, nothing of it is checkpointed, and the job restarts from its newest checkpoint
    (worker/replica_check.py). Every rank raises it alike: rank 0 alone says it."""

    reported_by_rank0 = True

    def __init__(self, step: int, described: str, nodes: list[str]) -> None:
        self.step = step
        self.nodes = nodes
        where = f" on {', '.join(nodes)}" if nodes else ""
        super().__init__(
            f"the replicas' state differs after step {step}: {described}{where}; no "
            "checkpoint of this state is written and the job restarts from its newest "
            "checkpoint (check that node's GPU and memory: repeated on the same node, take "
            "it out of the job)")
