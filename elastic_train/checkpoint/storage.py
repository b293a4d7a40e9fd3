"""On-disk checkpoints: format, atomic write, manifest with checksums, listing, retention.

Layout under ``<run_dir>/checkpoints``::

    step-00000050/state.pt        the payload (torch.save of tensors and plain data)
    step-00000050/manifest.json   step, world size, time, format version, sha256 of every
                                  payload file, model digest and tensor shapes, and the
                                  manifest's own checksum
    .tmp-step-00000100-<pid>-<hex>/   a save in progress (or torn by a crash)
    .trash-step-00000010-<hex>/       a checkpoint being deleted by retention

A save writes into a ``.tmp-`` directory, fsyncs every file and the directory, renames it to
``step-N`` and fsyncs the parent: the rename is the commit point. A crash at any instant
leaves either the old set, or the old set plus one complete new checkpoint (plus leftovers
whose names no reader takes for a checkpoint). Nothing here does collective calls.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elastic_train.checkpoint.api import (
    CheckpointInfo,
    CheckpointStorage,
    PayloadUpload,
    Serialized,
    Verdict,
)
from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)

FORMAT = "elastic_train.checkpoint"
FORMAT_VERSION = 1
PAYLOAD = "state.pt"
MANIFEST = "manifest.json"
SHARDED = "sharded"
"""The manifest's key of a sharded checkpoint's index (checkpoint/sharded.py)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER_PREFIXES = (".tmp-", ".trash-")
_HASH_CHUNK = 8 << 20


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


class _HashingWriter:
    """A file wrapper that hashes and counts what passes through ``write``."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        try:
            return self._file.write(data)
        except OSError as exc:  # torch.save reports it as a bare RuntimeError: keep the cause
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def serialize(payload: Mapping[str, Any]) -> Serialized:
    """torch.save ``payload`` into memory, hashing as it goes."""
    buffer = io.BytesIO()
    writer = _HashingWriter(buffer)  # type: ignore[arg-type]
    torch.save(dict(payload), writer)
    return Serialized(buffer.getbuffer(), writer.sha256.hexdigest())


def build_manifest(step: int, meta: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]]
                   ) -> dict[str, Any]:
    """The manifest of checkpoint ``step``: ``meta``, the format, the files' sizes and
    sha256, and its own checksum (any edit shows)."""
    manifest: dict[str, Any] = {
        **meta,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "time": time.time(),
        "files": {name: dict(entry) for name, entry in files.items()},
    }
    manifest["manifest_sha256"] = _manifest_checksum(manifest)
    return manifest


def manifest_problem(manifest: Any, step: int) -> str | None:
    """Why a parsed manifest of checkpoint ``step`` is not to be trusted (None: it is)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return "manifest.json is not an elastic_train manifest"
    if manifest.get("manifest_sha256") != _manifest_checksum(manifest):
        return "manifest.json was edited (its checksum does not match)"
    if manifest.get("step") != step:
        return f"manifest.json says step {manifest.get('step')}, the directory says {step}"
    return None


def unreadable_verdict(info: CheckpointInfo) -> Verdict | None:
    """The verdict on a checkpoint whose manifest is unreadable or of another format
    version, before any payload is read (None: its payloads are to be checked)."""
    if info.manifest is None:
        return Verdict(info, False, info.problem)
    problem = format_problem(info.manifest)
    return None if problem is None else Verdict(info, False, problem)


def format_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why a checkpoint of another format version cannot be read (None: it can)."""
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        return (f"format version {version} is not {FORMAT_VERSION} (written by another "
                "elastic_train version)")
    return None


def load_payload(source: Any, where: object, map_location: str | torch.device
                 ) -> dict[str, Any]:
    """torch.load with ``weights_only=True`` (no pickled code ever runs), its failures as
    our errors naming ``where``."""
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_global(str(exc))
        if refused is None:
            raise CheckpointCorruptError(
                f"checkpoint {where} is not a readable torch payload; it was not "
                "loaded") from None
        raise UnsafeCheckpointError(
            f"checkpoint {where} holds a pickled {refused} that safe loading refuses to "
            "run; it was not loaded — delete it if you did not write it") from None
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {where} is not readable on this host: put the run directory "
            "on storage that every node mounts, or in an object store (s3://)") from None
    except (RuntimeError, OSError, EOFError) as exc:
        raise CheckpointCorruptError(f"checkpoint {where} cannot be read ({exc})") \
            from None


def model_digest(model_state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order.

    Equal digests mean bitwise-equal weights, whatever the file bytes around them.
    """
    digest = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        for chunk in _tensor_bytes(tensor):
            digest.update(chunk)
    return digest.hexdigest()


def _tensor_bytes(tensor: torch.Tensor, chunk: int = _HASH_CHUNK) -> Iterator[memoryview]:
    """The raw bytes of a contiguous CPU tensor, in chunks, without copying them (no numpy
    needed); valid while ``tensor`` lives."""
    total = tensor.numel() * tensor.element_size()
    if total == 0:
        return
    view = memoryview((ctypes.c_ubyte * total).from_address(tensor.data_ptr())).cast("B")
    for offset in range(0, total, chunk):
        yield view[offset:offset + chunk]


def tensor_shapes(model_state: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """{name: [dtype, shape]} of a model state, stored in the manifest for cheap checks."""
    return {name: [str(t.dtype), list(t.shape)] for name, t in model_state.items()}


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class CheckpointStore(CheckpointStorage):
    """The checkpoints of one run directory, on a filesystem (local or shared)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # ---- writing -------------------------------------------------------------------------
    def write(self, step: int, payload: Mapping[str, Any] | Serialized, meta: Mapping[str, Any],
              *, fault_hook: Any = None,
              before_commit: Callable[[], None] | None = None,
              upload: PayloadUpload | None = None) -> CheckpointInfo:
        """Atomically write ``payload`` as checkpoint ``step``; return its info.

        ``meta`` goes into the manifest (world size, model digest and shapes, task, ...).
        ``fault_hook(stage)`` is called between the stages of the save (tests crash there).
        ``before_commit()`` runs just before the rename; what it raises abandons the save
        (the writer fence, fence.py). ``upload`` is for remote stores: a local write has
        nothing to upload (``remote`` is False, so the manager never gives one).
        """
        hook = fault_hook or (lambda stage: None)
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dirname(step)
        tmp = self.root / f".tmp-{step_dirname(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            hook("tmp-created")
            with open(tmp / PAYLOAD, "wb") as f:
                if isinstance(payload, Serialized):
                    f.write(payload.data)
                    entry = {"bytes": payload.bytes, "sha256": payload.sha256}
                else:
                    writer = _HashingWriter(f)
                    try:
                        torch.save(dict(payload), writer)
                    except RuntimeError:
                        if writer.error is not None:
                            raise writer.error from None
                        raise
                    entry = {"bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}
                hook("payload-written")
                f.flush()
                os.fsync(f.fileno())
            hook("payload-synced")
            manifest = build_manifest(step, meta, {PAYLOAD: entry})
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            hook("manifest-synced")
            if before_commit is not None:
                before_commit()
            if final.exists():
                self._set_aside(final)
            os.rename(tmp, final)
            hook("renamed")
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return CheckpointInfo(final, step, manifest)

    def _set_aside(self, path: Path) -> Path:
        """Move an existing (necessarily invalid) checkpoint out of the way, keeping its bytes."""
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}-{secrets.token_hex(2)}")
        os.rename(path, aside)
        return aside

    def set_aside(self, info: CheckpointInfo) -> Path:
        """Rename a corrupt checkpoint to ``step-N.corrupt-…``: out of every listing and of
        retention's count, its bytes kept for inspection."""
        aside = self._set_aside(info.path)
        fsync_dir(self.root)
        return aside

    def set_aside_dirs(self) -> list[Path]:
        """Checkpoints set aside as corrupt."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if ".corrupt-" in p.name)

    # ---- reading -------------------------------------------------------------------------
    def _step_dirs(self) -> Iterator[tuple[int, Path]]:
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                yield int(match.group(1)), entry

    def read_info(self, path: Path, step: int) -> CheckpointInfo:
        """Parse one checkpoint's manifest without reading the payload."""
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            return CheckpointInfo(path, step, None, "manifest.json is missing")
        except (OSError, ValueError) as exc:
            return CheckpointInfo(path, step, None, f"manifest.json is unreadable ({exc})")
        problem = manifest_problem(manifest, step)
        if problem is not None:
            return CheckpointInfo(path, step, None, problem)
        return CheckpointInfo(path, step, manifest)

    def list(self) -> list[CheckpointInfo]:
        """Every ``step-N`` checkpoint, newest first, with its manifest parsed (cheap)."""
        found = sorted(self._step_dirs(), reverse=True)
        return [self.read_info(path, step) for step, path in found]

    def verify(self, info: CheckpointInfo) -> Verdict:
        """Check the manifest, the format version and every payload file's size and sha256."""
        refused = unreadable_verdict(info)
        if refused is not None:
            return refused
        checked = 0
        for name, expected in info.manifest["files"].items():
            path = info.path / name
            if not path.is_file():
                return Verdict(info, False, f"{name} is missing")
            if path.stat().st_size != int(expected["bytes"]):
                return Verdict(info, False, f"{name} has {path.stat().st_size} bytes, the "
                               f"manifest says {expected['bytes']}")
            actual, size = _sha256_file(path)
            checked += size
            if actual != expected["sha256"]:
                return Verdict(info, False, f"{name} fails its sha256 checksum")
        return Verdict(info, True, None, checked)

    def load(self, info: CheckpointInfo, map_location: str | torch.device = "cpu"
             ) -> dict[str, Any]:
        """Read the payload with ``weights_only=True``: no pickled code ever runs."""
        return load_payload(info.path / PAYLOAD, info.path, map_location)

    def locate(self, path: str, step: int) -> CheckpointInfo:
        """A checkpoint chosen elsewhere (rank 0's decision), by its path."""
        return CheckpointInfo(Path(path), step, None)

    # ---- housekeeping --------------------------------------------------------------------
    def leftovers(self) -> list[Path]:
        """Temp and trash directories of saves or deletions that did not finish."""
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.name.startswith(_LEFTOVER_PREFIXES)]

    def remove_leftovers(self) -> list[Path]:
        """Delete the leftovers (only when no save of this run can be in flight)."""
        removed = self.leftovers()
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def apply_retention(self, keep: int, newest: int) -> list[Path]:
        """Keep the ``keep`` newest complete checkpoints up to step ``newest``; delete older.

        ``newest`` is the checkpoint just written (known good). Nothing at or above it is
        touched, it always counts as kept, and checkpoints with a broken manifest neither
        count nor get deleted: retention cannot leave a run without its last good one.
        """
        if keep < 1:
            raise ValueError("keep must be at least 1")
        complete = [info for info in self.list()
                    if info.manifest is not None and info.step <= newest]
        deleted = []
        for info in complete[keep:]:
            trash = self.root / f".trash-{info.path.name}-{secrets.token_hex(4)}"
            os.rename(info.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(info.path)
        if deleted:
            fsync_dir(self.root)
        return deleted


def _refused_global(message: str) -> str | None:
    """The global that weights_only loading refused, if that is why it failed."""
    match = re.search(r"unsupported GLOBAL ([\w.]+)", message)
    if match:
        return match.group(1)
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    return match.group(1) if match else None


def is_sharded_checkpoint(manifest: Mapping[str, Any] | None) -> bool:
    """Whether ``manifest`` is a sharded checkpoint's (checkpoint/sharded.py)."""
    return manifest is not None and SHARDED in manifest


def check_kind(path: object, manifest: Mapping[str, Any] | None, job_sharded: bool) -> None:
    """Refuse a checkpoint written sharded by an unsharded job, or the other way round:
    resuming it needs the ``--parallelism`` that wrote it (or an export of its weights)."""
    written_sharded = is_sharded_checkpoint(manifest)
    if written_sharded == job_sharded:
        return
    kinds = ("sharded (--parallelism fsdp or hsdp)", "unsharded (--parallelism ddp)")
    raise CheckpointMismatchError(
        f"checkpoint {path} is {kinds[not written_sharded]} and this job is "
        f"{kinds[written_sharded]}: resume it with the --parallelism that wrote it, "
        "or start a new --run-dir from its weights (elastic-train checkpoints export)")


def check_compatible(info: CheckpointInfo, expected_shapes: Mapping[str, list[Any]]) -> None:
    """Refuse a checkpoint whose model tensors differ from ours, naming the first mismatch."""
    assert info.manifest is not None
    theirs: Mapping[str, list[Any]] = info.manifest.get("model_shapes", {})
    fix = ("use a new --run-dir, or the --task and task options that wrote it; "
           "the checkpoint was left untouched")
    for name, (dtype, shape) in expected_shapes.items():
        if name not in theirs:
            raise CheckpointMismatchError(
                f"checkpoint {info.path} is for another model: it has no tensor {name!r}; {fix}")
        their_dtype, their_shape = theirs[name]
        if list(their_shape) != list(shape) or their_dtype != dtype:
            raise CheckpointMismatchError(
                f"checkpoint {info.path} is for another model: tensor {name!r} is "
                f"{their_dtype}{list(their_shape)} there and {dtype}{list(shape)} here; {fix}")
    extra = sorted(set(theirs) - set(expected_shapes))
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {info.path} is for another model: it has tensor {extra[0]!r} that "
            f"this model lacks; {fix}")
