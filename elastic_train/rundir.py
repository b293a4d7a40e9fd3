"""The run directory's layout, in one value: where checkpoints, the event log and samples live.

A run directory is a local (or shared) path, or an object store URL (``s3://bucket/prefix``).

On a filesystem::

    <run_dir>/
      checkpoints/step-<N>/   checkpoint/storage.py's format (state, manifest, checksum)
      events.jsonl            the event log (events/log.py; its schema: events/schema.py)
      samples/rank-<R>.jsonl  which samples each rank trained on (--record-samples)
      writers/epoch-<E>       the worlds that wrote checkpoints here (checkpoint/fence.py)

In an object store, which has no append, each node writes its event log and sample records
to a local directory and uploads them (every ``publish_seconds``, at every checkpoint's
commit and at exit) as objects of its own; readers merge the nodes' copies::

    s3://bucket/prefix/
      checkpoints/step-<N>/   checkpoint/object_checkpoints.py's format
      writers/epoch-<E>       created by a conditional write
      nodes/<node>/events.jsonl.<part>, nodes/<node>/samples/rank-<R>.jsonl.<part>

A node's local directory (``--storage-opt local_dir``, ``$ELASTIC_TRAIN_LOCAL_DIR``, else
under the system's temp) holds nothing the job cannot lose: a node lost takes at most its
last ``publish_seconds`` of events with it, never a checkpoint.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import secrets
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_train.config import RunLocation, StorageConfig
from elastic_train.errors import ConfigError, StorageError

if TYPE_CHECKING:  # checkpoint/ imports torch: the launcher reads a run dir before it
    from elastic_train.checkpoint.api import CheckpointStorage

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
CHECKPOINTS_DIR = "checkpoints"
SAMPLES_DIR = "samples"
WRITERS_DIR = "writers"
NODES_DIR = "nodes"
LOCAL_DIR_ENV = "ELASTIC_TRAIN_LOCAL_DIR"
PART_BYTES = 4 << 20
"""A node's log is uploaded in parts of this size: a long job's log is not sent again
whole at every upload, only its last part."""


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created until ``prepare``).

    ``root`` is the local directory that holds the event log and sample records: the run
    directory itself, or, for an object store, this node's local directory for it.
    """

    root: Path
    location: RunLocation
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __init__(self, location: str | os.PathLike[str],
                 storage: StorageConfig | None = None) -> None:
        storage = storage or StorageConfig()
        object.__setattr__(self, "storage", storage)
        text = os.fspath(location)
        if "://" in text:
            from elastic_train.checkpoint.object_store import ObjectLocation

            where = ObjectLocation.parse(text)
            object.__setattr__(self, "location", text)
            object.__setattr__(self, "root", _local_dir(where.bucket, where.prefix, storage))
        else:
            object.__setattr__(self, "location", Path(text))
            object.__setattr__(self, "root", Path(text))

    @property
    def remote(self) -> bool:
        """Whether the run directory is an object store."""
        return isinstance(self.location, str)

    def __str__(self) -> str:
        return str(self.location)

    # ---- local paths ---------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path | str:
        """The checkpoint store's root (a URL for an object store)."""
        if self.remote:
            return f"{self.location.rstrip('/')}/{CHECKPOINTS_DIR}"  # type: ignore[union-attr]
        return self.root / CHECKPOINTS_DIR

    @property
    def events(self) -> Path:
        """The event log, written by rank 0 (this node's copy for an object store)."""
        return self.root / EVENTS_FILE

    @property
    def samples(self) -> Path:
        """The per-rank sample records' directory (this node's, for an object store)."""
        return self.root / SAMPLES_DIR

    @property
    def writers(self) -> Path:
        """The writer epochs: which world may commit checkpoints (checkpoint/fence.py)."""
        return self.root / WRITERS_DIR

    def samples_of(self, rank: int) -> Path:
        """The sample record of one rank."""
        return self.samples / f"rank-{rank}.jsonl"

    # ---- stores --------------------------------------------------------------------------
    def objects(self) -> Any:
        """The object store client of an ``s3://`` run directory (one per RunDir: a boto3
        client is made once, and again in a forked child)."""
        return self._objects

    @functools.cached_property
    def _objects(self) -> Any:
        from elastic_train.checkpoint.object_store import ObjectLocation, ObjectStore

        assert self.remote
        return ObjectStore(ObjectLocation.parse(str(self.location)), self.storage)

    def _key(self, *parts: str) -> str:
        from elastic_train.checkpoint.object_store import ObjectLocation

        return ObjectLocation.parse(str(self.location)).key(*parts)

    def checkpoint_store(self) -> CheckpointStorage:
        """Where checkpoints are committed (checkpoint/api.py): on the filesystem, or in the
        object store of an ``s3://`` run directory."""
        if self.remote:
            from elastic_train.checkpoint.object_checkpoints import ObjectCheckpointStore

            return ObjectCheckpointStore(self.objects(), self._key(CHECKPOINTS_DIR))
        from elastic_train.checkpoint.storage import CheckpointStore

        return CheckpointStore(self.root / CHECKPOINTS_DIR)

    def writer_fence(self) -> Any:
        """The writer epochs (checkpoint/fence.py) where this run directory keeps them."""
        from elastic_train.checkpoint.fence import ObjectWriterFence, WriterFence

        if self.remote:
            return ObjectWriterFence(self.objects(), self._key(WRITERS_DIR))
        return WriterFence(self.writers)

    # ---- checks --------------------------------------------------------------------------
    def prepare(self) -> RunDir:
        """Create the directory (and its checkpoint store) and prove it writable; for an
        object store, prove the bucket reachable and writable and make the local one."""
        if self.remote:
            objects = self.objects()
            probe = self._key(f".write-probe-{socket.gethostname()}-{os.getpid()}")
            try:
                objects.put(probe, b"ok")
                objects.delete([probe])
            except StorageError as exc:
                raise type(exc)(f"run directory {self.location}: {exc}") from None
        probe_dir = self.root if self.remote else self.root / CHECKPOINTS_DIR
        probe_path = self.root / f".write-probe-{os.getpid()}"
        existed = probe_dir.is_dir()
        try:
            probe_dir.mkdir(parents=True, exist_ok=True)
            probe_path.write_bytes(b"ok")
            probe_path.unlink()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and existed:
                # Writable, only full for now (a fault a job lives through): checkpoints
                # fail and are retried, the logs keep their lines until there is space.
                probe_path.unlink(missing_ok=True)
                log.warning("run directory %s is full (%s): checkpoints fail until there "
                            "is space (--on-save-failure decides)", self.root, exc.strerror)
                return self
            what = "local directory" if self.remote else "run directory"
            fix = ("choose another with --storage-opt local_dir=... or "
                   f"${LOCAL_DIR_ENV}") if self.remote else "choose another --run-dir"
            raise ConfigError(f"{what} {self.root} is not writable "
                              f"({exc.strerror or exc}): {fix} or fix its "
                              "permissions") from None
        return self

    def exists(self) -> bool:
        """Whether there is anything to read: the directory, or the bucket (raises our
        error naming the endpoint when the object store does not answer)."""
        if not self.remote:
            return self.root.is_dir()
        self.objects().check_bucket()
        return True

    # ---- an object store's per-node files ------------------------------------------------
    def node_id(self) -> str:
        """This node's name in ``nodes/``: its host name and a random tag kept in its local
        directory (two nodes never share one; a node's incarnations do)."""
        tag_file = self.root / ".node"
        try:
            tag = tag_file.read_text().strip()
        except OSError:
            tag = ""
        if not tag:
            tag = secrets.token_hex(3)
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = tag_file.with_name(f".node.{os.getpid()}")
            tmp.write_text(tag)
            os.replace(tmp, tag_file)  # one winner among this node's workers
            tag = tag_file.read_text().strip()
        return f"{socket.gethostname()}-{tag}"

    def _remote_of(self, path: Path) -> str:
        relative = path.relative_to(self.root).as_posix()
        return self._key(NODES_DIR, self.node_id(), relative)

    def publish(self, paths: list[Path], done: dict[Path, int] | None = None) -> None:
        """Upload these local files as this node's copies (no-op on a filesystem), in
        parts of about ``PART_BYTES`` cut at line ends: ``done`` (updated) counts the
        complete parts of each file already uploaded, which are never sent again."""
        if not self.remote:
            return
        done = {} if done is None else done
        objects = self.objects()
        for path in paths:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            parts = _parts(data)
            remote = self._remote_of(path)
            for index in range(done.get(path, 0), len(parts)):
                objects.put(f"{remote}.{index:05d}", parts[index])
            done[path] = len(parts) - 1

    def _gathered(self, suffix: str, skip: str | None = None) -> dict[str, list[str]]:
        """{file name: lines} of every node's uploaded files ending in ``suffix``, each
        node's parts in order, all nodes' lines together; ``skip``: a node's key prefix."""
        objects = self.objects()
        files: dict[str, list[tuple[str, str]]] = {}
        for listed in objects.list(self._key(NODES_DIR) + "/"):
            base, dot, index = listed.key.rpartition(".")
            if not dot or not index.isdigit() or not base.endswith(suffix):
                continue
            if skip is not None and listed.key.startswith(skip):
                continue
            files.setdefault(base, []).append((index, listed.key))
        lines: dict[str, list[str]] = {}
        for base, parts in files.items():
            text = "".join((objects.get(key) or b"").decode(errors="replace")
                           for _, key in sorted(parts))
            lines.setdefault(base.rsplit("/", 1)[-1], []).extend(text.splitlines())
        return lines

    def gathered_events(self) -> Path:
        """A local file with every node's events, merged in time order (on a filesystem:
        the event log itself). This node's own copy is read locally (the freshest)."""
        if not self.remote:
            return self.events
        own = self._remote_of(self.events) if self.events.exists() else None
        lines = _lines(self.events)
        lines += self._gathered("/" + EVENTS_FILE, skip=own).get(EVENTS_FILE, [])
        merged = self.root / "gathered" / EVENTS_FILE
        _write_merged(merged, lines)
        return merged

    def gathered_samples(self) -> Path:
        """A local directory with one ``rank-<R>.jsonl`` per rank, merged from every node
        in time order (on a filesystem: the samples directory itself)."""
        if not self.remote:
            return self.samples
        by_rank = {name: lines for name, lines in self._gathered(".jsonl").items()
                   if name.startswith("rank-")}
        out = self.root / "gathered" / SAMPLES_DIR
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("rank-*.jsonl"):
            stale.unlink()
        for name, lines in by_rank.items():
            _write_merged(out / name, lines)
        return out


def _parts(data: bytes, size: int | None = None) -> list[bytes]:
    """An append-only file cut into parts of at least ``size`` bytes, each ending at the
    first line end past that size (the last part: the rest). Where a file is cut never
    moves as it grows, so a complete part is the same bytes at every upload."""
    size = size or PART_BYTES
    parts, start = [], 0
    while len(data) - start > size:
        cut = data.find(b"\n", start + size - 1)
        if cut < 0:
            break
        parts.append(data[start:cut + 1])
        start = cut + 1
    parts.append(data[start:])
    return parts


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _write_merged(path: Path, lines: list[str]) -> None:
    """Complete JSON lines sorted by their ``time`` (a torn last line is dropped)."""
    records = []
    for line in lines:
        try:
            records.append((float(json.loads(line).get("time", 0)), line))
        except (ValueError, AttributeError, TypeError):
            continue
    records.sort(key=lambda r: r[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(line + "\n" for _, line in records))
    os.replace(tmp, path)


def _local_dir(bucket: str, prefix: str, storage: StorageConfig) -> Path:
    base = storage.local_dir or os.environ.get(LOCAL_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"elastic_train-{os.getuid()}")
    tag = hashlib.sha256(f"{bucket}/{prefix}".encode()).hexdigest()[:10]
    name = f"{bucket}-{prefix.replace('/', '_')}"[:60]
    return Path(base) / f"{name}-{tag}"


class Publisher:
    """Uploads a worker's local files of an object-store run directory: every
    ``publish_seconds`` on a daemon thread, and whenever ``publish_now`` is called (a
    checkpoint committed, the worker's exit). A failed upload is logged once per outage,
    never raised: losing the view of a job must not stop it."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._paths: list[Path] = []
        self._sizes: dict[Path, int] = {}
        self._done: dict[Path, int] = {}  # complete parts uploaded, per file
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def track(self, path: Path) -> None:
        """Upload ``path`` from now on (a file this worker appends to)."""
        if not self.run_dir.remote:
            return
        with self._lock:
            if path not in self._paths:
                self._paths.append(path)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="run-dir-publisher",
                                            daemon=True)
            self._thread.start()

    def publish_now(self, force: bool = False) -> None:
        """Upload the tracked files that grew since their last upload."""
        if not self.run_dir.remote:
            return
        with self._lock:
            changed = []
            for path in self._paths:
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                if force or self._sizes.get(path) != size:
                    changed.append((path, size))
            try:
                self.run_dir.publish([path for path, _ in changed], self._done)
            except StorageError as exc:
                if not self._failing:
                    log.warning("could not upload the event log and sample records (%s); "
                                "training goes on, they are tried again", exc)
                self._failing = True
                return
            self._failing = False
            self._sizes.update(changed)

    def _loop(self) -> None:
        while not self._stop.wait(self.run_dir.storage.publish_seconds):
            self.publish_now()

    def close(self) -> None:
        """Stop the thread and upload what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.run_dir.storage.publish_seconds + 5)
        self.publish_now()


def prepare_run_dir(run_dir: str | os.PathLike[str], storage: StorageConfig | None = None
                    ) -> Path:
    """Create ``run_dir`` (and its checkpoint store) and prove it writable; returns the
    local directory that holds its logs."""
    return RunDir(run_dir, storage).prepare().root
