"""Checkpoints: on-disk format and atomic writes (storage), policy and restore (manager),
the ``--on-save-failure stop`` vote (stop)."""

from elastic_train.checkpoint.manager import CheckpointManager, Restored, snapshot_state
from elastic_train.checkpoint.storage import CheckpointInfo, CheckpointStore, model_digest

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointStore", "Restored",
           "model_digest", "snapshot_state"]
