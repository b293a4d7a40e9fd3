"""A sharded save's writing (``--parallelism fsdp|hsdp``; the layout: sharded.py): every rank
encodes its parts once (for its file and for the memory tier), writes them and then its
sidecar into the save's temp directory; rank 0 waits for every sidecar, digests the whole
model from the parts, writes the manifest, checks the writer fence and commits by rename."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from elastic_train.checkpoint.sharded import (
    COMMON,
    MODEL,
    PART_MAGIC,
    ShardedSnapshot,
    shard_file,
    sidecar_file,
)
from elastic_train.checkpoint.sharded_restore import full_tensors
from elastic_train.checkpoint.storage import (
    MANIFEST,
    SHARDED,
    CheckpointInfo,
    CheckpointStore,
    build_manifest,
    fsync_dir,
    model_digest,
    step_dirname,
)
from elastic_train.errors import StorageError

__all__ = ["EncodedShards", "SaveAbandoned", "commit", "encode", "write_rank"]

POLL_SECONDS = 0.02
"""How often rank 0 looks for the other ranks' sidecars."""


class SaveAbandoned(Exception):
    """Rank 0 stopped waiting for the shards of a save: the world that took it re-formed
    (live recovery) before every rank wrote its shard. The last good checkpoint stays."""


def _write_atomically(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


@dataclass
class EncodedShards:
    """One rank's files of a save, serialised once: for its write into the save's
    directory and, as payloads (``payloads``), for the agents' memory tier."""

    rank: int
    world_size: int
    files: dict[str, bytes]
    """``shard-R.safetensors`` (its parts) and, on rank 0, ``common.pt``."""
    sidecar: dict[str, Any]
    """Its parts' index entries and its files' sizes and sha256."""

    def payloads(self) -> dict[int, bytes]:
        """What this rank gives the memory tier, by part: part R its shards, and on rank 0
        part W (the world size) the common state, apart so that a rank that needs only
        that does not fetch rank 0's shards too. Each one is ``PART_MAGIC``, the length of
        a JSON header (8 bytes, little-endian), the header (the sidecar, and where each
        file's bytes start and end), then the files' bytes."""
        out = {self.rank: _framed(
            {"rank": self.rank, "world_size": self.world_size, "parts": self.sidecar["parts"]},
            {n: d for n, d in self.files.items() if n != COMMON})}
        if COMMON in self.files:
            out[self.world_size] = _framed({"rank": self.rank, "world_size": self.world_size,
                                            "parts": []}, {COMMON: self.files[COMMON]})
        return out


def _framed(sidecar: Mapping[str, Any], files: Mapping[str, bytes]) -> bytes:
    spans, at = {}, 0
    for name, data in files.items():
        spans[name] = [at, at + len(data)]
        at += len(data)
    header = json.dumps({"sidecar": dict(sidecar), "spans": spans}).encode()
    return b"".join([PART_MAGIC, len(header).to_bytes(8, "little"), header, *files.values()])


def encode(shot: ShardedSnapshot) -> EncodedShards:
    """This rank's files of a save: its parts as safetensors, rank 0's common state as
    ``torch.save`` bytes (read back weights-only), and the sidecar that indexes them."""
    files: dict[str, bytes] = {}
    if shot.tensors:
        files[shard_file(shot.rank)] = safetensors_bytes(
            {k: t.contiguous() for k, t in shot.tensors.items()})
    if shot.common is not None:
        buffer = io.BytesIO()
        torch.save(shot.common, buffer)
        files[COMMON] = buffer.getvalue()
    sidecar = {"rank": shot.rank, "world_size": shot.world_size,
               "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                         for name, data in files.items()},
               "parts": [{"path": p.path, "whole": p.whole, "dtype": p.dtype,
                          **p.entry(shard_file(shot.rank))} for p in shot.parts]}
    return EncodedShards(shot.rank, shot.world_size, files, sidecar)


def write_rank(staging: Path, shot: ShardedSnapshot, encoded: EncodedShards | None = None
               ) -> None:
    """This rank's file (and rank 0's ``common.pt``), then its sidecar, into ``staging``
    (``encoded``: the files serialised already, for the memory tier)."""
    encoded = encoded or encode(shot)
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in encoded.files.items():
        _write_atomically(staging / name, data)
    _write_atomically(staging / sidecar_file(shot.rank), json.dumps(encoded.sidecar).encode())
    fsync_dir(staging)


def _sidecars(staging: Path, world_size: int, timeout: float,
              abandoned: threading.Event | None = None) -> list[dict[str, Any]]:
    """Every rank's sidecar, waited for up to ``timeout`` seconds, or until ``abandoned``
    is set (``SaveAbandoned``)."""
    deadline = time.monotonic() + timeout
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(world_size):
            if rank not in found and (staging / sidecar_file(rank)).is_file():
                found[rank] = json.loads((staging / sidecar_file(rank)).read_text())
        if len(found) == world_size:
            return [found[r] for r in range(world_size)]
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if r not in found]
            raise StorageError(
                f"ranks {missing} wrote no shard of this checkpoint into {staging} within "
                f"{timeout:g} s: a rank died, or the run directory is not one that every "
                "node shares (a sharded checkpoint needs a shared filesystem)")
        if abandoned is None:
            time.sleep(POLL_SECONDS)
        elif abandoned.wait(POLL_SECONDS):
            missing = [r for r in range(world_size) if r not in found]
            raise SaveAbandoned(f"the world re-formed before ranks {missing} wrote their "
                                f"shards into {staging}")


def commit(store: CheckpointStore, step: int, staging: Path, world_size: int,
           meta: Mapping[str, Any], *, timeout: float,
           before_commit: Callable[[], None] | None = None,
           abandoned: threading.Event | None = None) -> CheckpointInfo:
    """Rank 0: wait for every rank's shards, index them, and commit the checkpoint
    (``SaveAbandoned`` when ``abandoned`` is set before they are all in)."""
    sidecars = _sidecars(staging, world_size, timeout, abandoned)
    files: dict[str, dict[str, Any]] = {}
    index: dict[str, dict[str, Any]] = {}
    for sidecar in sidecars:
        files.update(sidecar["files"])
        for part in sidecar["parts"]:
            entry = index.setdefault(part["path"], {"dtype": part["dtype"],
                                                    "shape": part["whole"], "parts": []})
            entry["parts"].append({k: part[k] for k in ("file", "key", "offset", "shape")})
    if COMMON not in files:
        raise StorageError(f"rank 0's {COMMON} is missing from {staging}")
    model = full_tensors(staging, index, prefix=f"{MODEL}/")
    manifest = build_manifest(step, {
        **meta, "world_size": world_size, "model_digest": model_digest(model),
        "model_shapes": {n: [str(t.dtype), list(t.shape)] for n, t in model.items()},
        SHARDED: {"world_size": world_size, "tensors": index}}, files)
    _write_atomically(staging / MANIFEST, json.dumps(manifest, indent=1,
                                                     sort_keys=True).encode())
    for rank in range(world_size):
        (staging / sidecar_file(rank)).unlink()
    fsync_dir(staging)
    if before_commit is not None:
        before_commit()
    final = store.root / step_dirname(step)
    if final.exists():
        store.set_aside(store.read_info(final, step))
    os.rename(staging, final)
    fsync_dir(store.root)
    return CheckpointInfo(final, step, manifest)


