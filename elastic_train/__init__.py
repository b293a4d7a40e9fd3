"""elastic_train: elastic, fault-tolerant DDP training for PyTorch.

Importing the package has no side effects: no environment reads, no logging setup, no
process group, no server.
"""

from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    DistributedError,
    ElasticTrainError,
    MetricsError,
    ReportError,
    TaskError,
    UnsafeCheckpointError,
)
from elastic_train.tasks.base import Task, TaskContext

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigError",
    "DistributedError",
    "ElasticTrainError",
    "MetricsError",
    "ReportError",
    "Task",
    "TaskContext",
    "TaskError",
    "UnsafeCheckpointError",
    "__version__",
]
