"""The contract of a checkpoint store: what the checkpoint manager, the restore, the
``checkpoints`` and ``export`` commands and the sharded save ask of the place a run
directory keeps its checkpoints. Where the system is extended (a GCS or Azure bucket, a
filesystem with other rules), this is what to implement; ``tests/integration/
test_checkpoint_storage_contract.py`` runs one contract test on every implementation.

Implementations: ``storage.CheckpointStore`` (a filesystem: a rename commits) and
``object_checkpoints.ObjectCheckpointStore`` (an S3-compatible object store: the manifest,
written last in one request, commits). What every implementation promises:

- **atomic commit**: a crash at any instant leaves the checkpoints committed before, plus
  at most one complete new one; a torn save is never listed and never restored, and what
  it left behind is a ``leftover`` that ``remove_leftovers`` deletes;
- **a manifest** per checkpoint with the sha256 of every payload file: ``verify`` checks
  them, ``load`` unpickles nothing but tensors and plain data (``weights_only``);
- ``before_commit`` runs just before the commit point and abandons the save by raising
  (the writer fence, fence.py): nothing of that save is ever listed;
- **nothing lost on a failure**: no failing path deletes or overwrites a committed
  checkpoint; a corrupt one is ``set_aside`` (its bytes kept), never deleted;
- ``apply_retention`` deletes the oldest beyond ``keep``, never the newest.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class CheckpointInfo:
    """What the manifest of one checkpoint says (``manifest`` is None when it is unreadable)."""

    path: Path
    step: int
    manifest: Mapping[str, Any] | None
    problem: str | None = None

    @property
    def world_size(self) -> int | None:
        return None if self.manifest is None else self.manifest.get("world_size")

    @property
    def time(self) -> float | None:
        return None if self.manifest is None else self.manifest.get("time")

    @property
    def size_bytes(self) -> int:
        if self.manifest is None:
            return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
        return sum(int(f["bytes"]) for f in self.manifest["files"].values())

    @property
    def model_digest(self) -> str | None:
        return None if self.manifest is None else self.manifest.get("model_digest")


@dataclass
class Verdict:
    """The result of verifying one checkpoint's bytes."""

    info: CheckpointInfo
    valid: bool
    problem: str | None = None
    checked_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Serialized:
    """A payload serialised once (torch.save), with its checksum: what the memory tier and
    an object store are given, and what a local write can take instead of the state."""

    data: bytes | memoryview
    sha256: str

    @property
    def bytes(self) -> int:
        return len(self.data)


PayloadUpload = Callable[[str, Mapping[str, Any], Serialized], bool]
"""Uploads a save's payload for the store: ``(URL, how to reach the store (client
options), payload)``; the agent's holder, which keeps the same bytes (agent/write_behind.py).
False: it could not try, and the store uploads it itself."""


class CheckpointStorage(abc.ABC):
    """The checkpoints of one run directory (module doc: the promises)."""

    root: Any
    """Where the checkpoints live, for messages (a Path, or a URL)."""

    remote: ClassVar[bool] = False
    """The payload leaves this host: the manager serializes it in memory once (the memory
    tier takes the same bytes), and the agent's holder may upload it (``write``'s
    ``upload``)."""

    @abc.abstractmethod
    def write(self, step: int, payload: Mapping[str, Any] | Serialized,
              meta: Mapping[str, Any], *, fault_hook: Any = None,
              before_commit: Callable[[], None] | None = None,
              upload: PayloadUpload | None = None) -> CheckpointInfo:
        """Commit ``payload`` as checkpoint ``step`` with ``meta`` in its manifest.
        ``fault_hook(stage)`` runs between the stages (tests crash there); ``upload`` (a
        ``remote`` store only) uploads the payload instead of this process."""

    @abc.abstractmethod
    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint, newest first (a corrupt manifest: ``problem`` set)."""

    @abc.abstractmethod
    def verify(self, info: CheckpointInfo) -> Verdict:
        """Check the checkpoint's bytes against its manifest."""

    @abc.abstractmethod
    def load(self, info: CheckpointInfo, map_location: str | torch.device = "cpu"
             ) -> dict[str, Any]:
        """The payload (tensors and plain data only; raises CheckpointCorruptError)."""

    @abc.abstractmethod
    def locate(self, path: str, step: int) -> CheckpointInfo:
        """A handle on the checkpoint at ``path`` (as ``list`` gave it, on rank 0) of
        ``step``, for ``load`` on another rank: no request, no manifest read."""

    @abc.abstractmethod
    def read_info(self, path: Any, step: int) -> CheckpointInfo:
        """What the manifest at ``path`` says (``problem`` set when it cannot be read)."""

    @abc.abstractmethod
    def set_aside(self, info: CheckpointInfo) -> Any:
        """Move a corrupt checkpoint out of every listing, its bytes kept; where it went."""

    @abc.abstractmethod
    def set_aside_dirs(self) -> list[Any]:
        """The checkpoints set aside as corrupt."""

    @abc.abstractmethod
    def leftovers(self) -> list[Any]:
        """What torn or abandoned saves left behind."""

    @abc.abstractmethod
    def remove_leftovers(self) -> list[Any]:
        """Delete the leftovers (only when no save of the run can be in flight)."""

    @abc.abstractmethod
    def apply_retention(self, keep: int, newest: int) -> list[Any]:
        """Delete the oldest checkpoints beyond ``keep`` (never ``newest``); what went."""
