"""The run directory's layout, in one value: where checkpoints, the event log and samples live.

::

    <run_dir>/
      checkpoints/step-<N>/   checkpoint/storage.py's format (state, manifest, checksum)
      events.jsonl            the event log (observe/events.py; its schema: observe/event_schema.py)
      samples/rank-<R>.jsonl  which samples each rank trained on (--record-samples)
      writers/epoch-<E>       the worlds that wrote checkpoints here (checkpoint/fence.py)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from elastic_train.errors import ConfigError

EVENTS_FILE = "events.jsonl"
CHECKPOINTS_DIR = "checkpoints"
SAMPLES_DIR = "samples"
WRITERS_DIR = "writers"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created until ``prepare``)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def checkpoints(self) -> Path:
        """The checkpoint store's root."""
        return self.root / CHECKPOINTS_DIR

    @property
    def events(self) -> Path:
        """The event log, written by rank 0."""
        return self.root / EVENTS_FILE

    @property
    def samples(self) -> Path:
        """The per-rank sample records' directory."""
        return self.root / SAMPLES_DIR

    @property
    def writers(self) -> Path:
        """The writer epochs: which world may commit checkpoints (checkpoint/fence.py)."""
        return self.root / WRITERS_DIR

    def samples_of(self, rank: int) -> Path:
        """The sample record of one rank."""
        return self.samples / f"rank-{rank}.jsonl"

    def prepare(self) -> RunDir:
        """Create the directory and its checkpoint store, and prove they are writable."""
        probe = self.root / f".write-probe-{os.getpid()}"
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"run directory {self.root} is not writable "
                              f"({exc.strerror or exc}): choose another --run-dir or fix its "
                              "permissions") from None
        return self


def prepare_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """Create ``run_dir`` and its checkpoint store and prove it writable; returns its path."""
    return RunDir(run_dir).prepare().root
