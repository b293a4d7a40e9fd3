"""Which world may commit a run's checkpoints: writer epochs claimed in the run directory.

Every time a world forms over a run directory (a fresh start, a restart after a failure or
a resize, a new launch), its rank 0 claims the next *writer epoch* right after choosing the
checkpoint to resume from: it creates ``<run_dir>/writers/epoch-<E>`` with ``O_EXCL``, so
no two worlds ever hold the same epoch, and records there the step it resumed from. Every
checkpoint's manifest names the epoch that wrote it.

Before a checkpoint is committed (renamed into place), its writer checks that no newer
epoch exists. A world that finds one is stale: the job's rendezvous formed a newer world
without it (a partitioned minority, or a world whose agents already moved on), and that
world now owns the checkpoints. The stale world then stops without committing, so it never
replaces a checkpoint of the newer one. The check and the rename are two steps on a plain
file system; a checkpoint committed between them is recognised on every later restore:
an older epoch's checkpoint past the step a newer epoch resumed from is *superseded* (it
was written after the newer world had forked from that step) and is never chosen.

This is the rendezvous round used as a fencing token, kept where the protected resource
is: the claim happens once per rendezvous (every world restores once), the storage checks
it, and it works the same for every rendezvous backend and for ``ElasticSession``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_train.checkpoint.storage import fsync_dir
from elastic_train.errors import CheckpointFencedError

_EPOCH_FILE = re.compile(r"^epoch-(\d{8,})$")
FULL = (errno.ENOSPC, errno.EDQUOT)
NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV)
CLAIM_WAIT_SECONDS = 120.0
"""How long a world waits for a full run directory to take its claim (a restore or a
re-formation then waits; training goes on as soon as there is space)."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """One world's claim: its epoch, the step it resumed from (None: from scratch)."""

    epoch: int
    resumed_from: int | None
    run_id: str | None = None
    host: str | None = None
    pid: int | None = None
    time: float | None = None

    def describe(self) -> str:
        start = f"resumed from step {self.resumed_from}" if self.resumed_from is not None \
            else "started from scratch"
        when = time.strftime("%H:%M:%S", time.localtime(self.time)) if self.time else "?"
        return f"writer epoch {self.epoch} (host {self.host}, pid {self.pid}, {when}, {start})"


class WriterFence:
    """The writer epochs of one run directory (a local or shared filesystem)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    # ---- the three primitives a storage provides -----------------------------------------
    def _epochs(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for m in map(_EPOCH_FILE.match, os.listdir(self.directory))
                      if m)

    def _read_text(self, epoch: int) -> str | None:
        try:
            return (self.directory / f"epoch-{epoch:08d}").read_text()
        except OSError:
            return None

    def _create(self, epoch: int, record: bytes) -> bool:
        """Create epoch ``epoch``'s claim unless it exists; whether it did. The record is
        written to a file of its own first and then linked to its name (``link`` fails on
        an existing name, as ``O_EXCL`` does): a claim appears whole or not at all. (An
        empty claim, left by a write that a full disk refused, read as a world started
        from scratch and superseded every checkpoint: found by the fault campaign.)"""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"epoch-{epoch:08d}"
        staged = self.directory / f".epoch-{epoch:08d}.{os.getpid()}.{time.monotonic_ns()}"
        try:
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                if os.write(fd, record) != len(record):
                    raise OSError(errno.ENOSPC, "short write of a writer claim")
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(staged, final)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in NO_LINKS:
                    raise
                return self._create_in_place(final, record)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(staged)
        fsync_dir(self.directory)
        return True

    @staticmethod
    def _create_in_place(final: Path, record: bytes) -> bool:
        """``O_EXCL`` where the file system has no hard links; a claim that could not be
        written whole is removed again."""
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            if os.write(fd, record) != len(record):
                raise OSError(errno.ENOSPC, "short write of a writer claim")
            os.fsync(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(final)
            raise
        os.close(fd)
        return True

    # ---- claims --------------------------------------------------------------------------
    def _read(self, epoch: int) -> Claim:
        try:
            raw = json.loads(self._read_text(epoch) or "")
            return Claim(epoch, raw.get("resumed_from"), raw.get("run_id"), raw.get("host"),
                         raw.get("pid"), raw.get("time"))
        except (ValueError, AttributeError):
            return Claim(epoch, None)  # being written, or torn: still a claim

    def claims(self) -> list[Claim]:
        """Every claim, oldest first (an unreadable one counts, resumed from nothing)."""
        return [self._read(epoch) for epoch in self._epochs()]

    def newest(self) -> Claim | None:
        """The newest claim (one listing, one read)."""
        epochs = self._epochs()
        return self._read(epochs[-1]) if epochs else None

    def claim(self, resumed_from: int | None, run_id: str) -> int:
        """Claim the next epoch for this world (rank 0, once per world); its number."""
        newest = self.newest()
        epoch = newest.epoch + 1 if newest is not None else 1
        record = json.dumps({"resumed_from": resumed_from, "run_id": run_id,
                             "host": socket.gethostname(), "pid": os.getpid(),
                             "time": time.time()}).encode()
        deadline = time.monotonic() + CLAIM_WAIT_SECONDS
        said = False
        while True:
            try:
                if self._create(epoch, record):
                    return epoch
                epoch += 1  # another world claimed it first: the next one is ours
            except OSError as exc:
                if exc.errno not in FULL or time.monotonic() >= deadline:
                    raise
                if not said:
                    log.warning("the run directory is full (%s): this world waits up to "
                                "%.0f s for space to claim its writer epoch", exc.strerror,
                                CLAIM_WAIT_SECONDS)
                    said = True
                time.sleep(0.5)

    def check(self, epoch: int, step: int) -> None:
        """Before committing checkpoint ``step`` of ``epoch``: raise when a newer world owns
        the checkpoints."""
        newest = self.newest()
        if newest is not None and newest.epoch > epoch:
            raise CheckpointFencedError(step, epoch, newest.epoch, newest.describe())


class ObjectWriterFence(WriterFence):
    """The writer epochs of a run directory in an object store: ``writers/epoch-E``
    objects, created by a conditional write (``If-None-Match: *``) where the filesystem
    uses ``O_EXCL``. A server that ignores the condition (some S3-compatible ones) lets two
    worlds that claim at the same instant share an epoch: docs/object-storage.md."""

    def __init__(self, objects: Any, prefix: str) -> None:
        self.objects = objects
        self.prefix = prefix.strip("/")
        self.directory = Path(self.prefix)  # for messages only

    def _epochs(self) -> list[int]:
        names = (o.key.rsplit("/", 1)[-1] for o in self.objects.list(self.prefix + "/"))
        return sorted(int(m.group(1)) for m in map(_EPOCH_FILE.match, names) if m)

    def _read_text(self, epoch: int) -> str | None:
        raw = self.objects.get(f"{self.prefix}/epoch-{epoch:08d}")
        return None if raw is None else raw.decode(errors="replace")

    def _create(self, epoch: int, record: bytes) -> bool:
        return self.objects.put(f"{self.prefix}/epoch-{epoch:08d}", record, if_absent=True)


def superseded(written_by: int | None, step: int, claims: list[Claim]) -> bool:
    """Whether a checkpoint of ``step`` written by epoch ``written_by`` was committed after
    a newer world forked from an earlier step (then no restore may choose it)."""
    if written_by is None:  # written before writer epochs existed
        return False
    for claim in claims:
        if claim.epoch > written_by:
            base = claim.resumed_from if claim.resumed_from is not None else -1
            if step > base:
                return True
    return False
