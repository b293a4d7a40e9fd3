"""Model weights for use outside elastic_train: a plain state dict in a ``.safetensors`` or
torch (``.pt``, ``.pth``, ``.bin``) file, from a tensor mapping or a run's checkpoint.

A file is written under a temporary name in its directory, fsynced, then renamed over
``out``: a failure never leaves a partial file, nor replaces a good one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from elastic_train.checkpoint.api import CheckpointInfo, CheckpointStorage
from elastic_train.checkpoint.sharded_restore import full_tensors
from elastic_train.checkpoint.storage import SHARDED, model_digest
from elastic_train.errors import CheckpointCorruptError, CheckpointError, ConfigError

#: Accepted suffixes of ``out``; the first is written with safetensors, the rest torch.save.
SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


@dataclass(frozen=True)
class ExportResult:
    """What ``export_checkpoint`` wrote: checkpoint step, file, tensor count, file size, and
    the sha256 digest of the weights (the one ``elastic-train checkpoints list`` shows)."""

    step: int
    path: Path
    tensors: int
    bytes: int
    model_digest: str


class _Writer:
    """A file wrapper keeping the OSError of a failed write (torch.save reports a bare
    RuntimeError)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._file.flush()


def _cpu_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state entry {name!r} is a {type(value).__name__}, "
                                  "not a tensor: only tensors can be exported")
        tensors[name] = value.detach().to("cpu")
    return tensors


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing storage with another (safetensors refuses both);
    only what needs it is copied (a tied weight: its second name)."""
    seen: set[int] = set()
    out = {}
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
            pointer = tensor.untyped_storage().data_ptr()
        seen.add(pointer)
        out[name] = tensor
    return out


def _write_file(tensors: dict[str, torch.Tensor], suffix: str, tmp: Path) -> None:
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        with open(tmp, "wb"):  # created as a torch file would be: its mode follows the umask
            pass
        mode = stat.S_IMODE(tmp.stat().st_mode)
        try:
            save_file(_unshared(tensors), str(tmp), metadata={"format": "pt"})
        except SafetensorError as exc:  # what it raises for a failed write
            raise OSError(str(exc)) from exc
        os.chmod(tmp, mode)  # newer safetensors rename their own 0600 temp file over tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        return
    with open(tmp, "wb") as f:
        writer = _Writer(f)
        try:
            torch.save(tensors, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def check_weights_file(out: Path) -> str:
    """The format ``out`` will be written in (its suffix), or a ConfigError saying why it
    cannot be: checked before any work, so that a bad name fails at once."""
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        given = f"suffix {out.suffix!r}" if out.suffix else "no suffix"
        raise ConfigError(f"cannot write model weights to {out}: it has {given}; use one of "
                          f"{', '.join(SUFFIXES)}")
    if out.is_dir():
        raise ConfigError(f"cannot write model weights to {out}: it is a directory; give a "
                          "file name")
    return suffix


def write_weights(state: Mapping[str, torch.Tensor], out: Path) -> Path:
    """Write a plain state dict to ``out`` (format by suffix, see ``SUFFIXES``) atomically;
    return ``out``. A torch file loads with ``torch.load(out, weights_only=True)``."""
    out = Path(out)
    suffix = check_weights_file(out)
    tensors = _cpu_tensors(state)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_file(tensors, suffix, tmp)
        os.replace(tmp, out)
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"could not write model weights to {out} ({exc}): free space or "
                              "fix permissions; no file was written or replaced") from exc
    finally:
        with contextlib.suppress(OSError):  # gone after the rename, or never made
            tmp.unlink(missing_ok=True)
    return out


def _choose(store: CheckpointStorage, step: int | None) -> CheckpointInfo:
    infos = store.list()
    if not infos:
        raise CheckpointError(f"no checkpoints under {store.root}: nothing to export; pass "
                              "the run directory of a job that saved one")
    if step is None:
        problems = []
        for info in infos:
            verdict = store.verify(info)
            if verdict.valid:
                return info
            problems.append(f"{info.path.name}: {verdict.problem}")
        raise CheckpointCorruptError(
            f"none of the {len(infos)} checkpoints under {store.root} is valid "
            f"({'; '.join(problems)}); nothing was exported")
    chosen = [info for info in infos if info.step == step]
    if not chosen:
        steps = ", ".join(str(info.step) for info in infos)
        raise CheckpointError(f"no checkpoint of step {step} under {store.root}; the steps "
                              f"there are {steps}")
    verdict = store.verify(chosen[0])
    if not verdict.valid:
        raise CheckpointCorruptError(
            f"checkpoint {chosen[0].path} is corrupt ({verdict.problem}): pass another --step, "
            "or none for the newest valid checkpoint")
    return chosen[0]


def export_checkpoint(store: CheckpointStorage, out: Path, step: int | None = None
                      ) -> ExportResult:
    """Write the model weights of checkpoint ``step`` (default: the newest that verifies)
    to ``out`` with ``write_weights``; the checkpoint is only read."""
    info = _choose(store, step)
    if info.manifest is not None and SHARDED in info.manifest:  # gathered from its shards
        if not isinstance(info.path, Path):
            raise CheckpointError(f"checkpoint {info.path} is sharded: exporting one from an "
                                  "object store is not supported yet; copy it to a disk")
        payload: object = {"model": full_tensors(info.path, info.manifest[SHARDED]["tensors"],
                                                 prefix="model/")}
    else:
        payload = store.load(info, map_location="cpu")
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, Mapping):
        raise CheckpointError(f"checkpoint {info.path} holds no model weights (no 'model' "
                              "entry): it was not written by an elastic_train job")
    digest = model_digest(model)
    if info.model_digest is not None and digest != info.model_digest:
        raise CheckpointCorruptError(
            f"checkpoint {info.path} is corrupt (its model weights do not match the manifest's "
            "model digest): pass another --step, or none for the newest valid checkpoint")
    path = write_weights(model, out)
    return ExportResult(info.step, path, len(model), path.stat().st_size, digest)
