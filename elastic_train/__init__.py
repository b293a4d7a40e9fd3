"""elastic_train: elastic, fault-tolerant DDP training for PyTorch.

Importing the package has no side effects: no environment reads, no logging setup, no
process group, no server.
"""

from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointStopError,
    ConfigError,
    DistributedError,
    ElasticTrainError,
    MetricsError,
    NodeStoppedError,
    ReportError,
    TaskError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # These import torch; the launcher imports this package before torch (agent/worker_start.py).
    if name in ("Task", "TaskContext"):
        from elastic_train.tasks import base

        return getattr(base, name)
    if name == "ElasticSession":
        from elastic_train.worker.session import ElasticSession

        return ElasticSession
    raise AttributeError(f"module 'elastic_train' has no attribute {name!r}")

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointStopError",
    "ConfigError",
    "DistributedError",
    "ElasticSession",
    "ElasticTrainError",
    "MetricsError",
    "NodeStoppedError",
    "ReportError",
    "Task",
    "TaskContext",
    "TaskError",
    "UnsafeCheckpointError",
    "__version__",
]
