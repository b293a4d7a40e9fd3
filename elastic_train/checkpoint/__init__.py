"""Checkpoints: the on-disk format and atomic writes (storage), policy and restore (manager),
the state captured off the training thread (snapshot) and written in the background
(persister), the writer fence that keeps an older world from committing (fence), and a
plain state dict out of a checkpoint (export). The ``--on-save-failure stop`` vote is the
worker's (worker/save_failure.py).

The names below are loaded on first use: importing the package imports no torch, so the
agent (torch-free until its workers' server starts) can use ``checkpoint.object_store`` to
upload the payloads its holder keeps (agent/write_behind.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_train.checkpoint.api import CheckpointInfo, CheckpointStorage
    from elastic_train.checkpoint.manager import CheckpointManager, Restored, snapshot_state
    from elastic_train.checkpoint.storage import CheckpointStore, model_digest

__all__ = ["CheckpointInfo", "CheckpointManager", "CheckpointStorage", "CheckpointStore",
           "Restored", "model_digest", "snapshot_state"]

_HOME = {"CheckpointManager": "manager", "Restored": "manager", "snapshot_state": "manager",
         "CheckpointInfo": "api", "CheckpointStorage": "api", "CheckpointStore": "storage",
         "model_digest": "storage"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
