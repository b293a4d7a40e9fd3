"""Checkpoints: the on-disk format and atomic writes (storage), policy and restore (manager),
the state captured off the training thread (snapshot) and written in the background
(persister), the writer fence that keeps an older world from committing (fence), and a
plain state dict out of a checkpoint (export). The ``--on-save-failure stop`` vote is the
worker's (worker/save_failure.py)."""

from elastic_train.checkpoint.manager import CheckpointManager, Restored, snapshot_state
from elastic_train.checkpoint.storage import CheckpointInfo, CheckpointStore, model_digest

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointStore", "Restored",
           "model_digest", "snapshot_state"]
