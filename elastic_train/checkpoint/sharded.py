"""Sharded checkpoints (``--parallelism fsdp|hsdp``): every rank writes its own shards, rank 0
commits them, and any world size or mesh reads them back resharded.

Layout (the same step directories, temp names and commit by rename as storage.py)::

    step-00000050/common.pt                rank 0: the state that is not sharded (torch.save,
                                           loaded weights-only): scheduler, trainer,
                                           sampler, the optimizer's param groups and step
                                           counts, and a marker where each sharded tensor was
    step-00000050/shard-00003.safetensors  rank 3: its parts of the sharded tensors
    step-00000050/manifest.json            every file's size and sha256, and the index:
                                           {path: dtype, whole shape, parts [file, key,
                                           offset, shape]}; the model's digest and shapes

A save: every rank copies its local parts to host memory (what training waits for), then,
in the background, writes its file and a sidecar naming its parts and their checksum into
the save's temp directory (``.tmp-step-N-eE``: the same name on every rank, E the writer
epoch). Rank 0 waits for every rank's sidecar, reads the model's parts back to digest the
whole model, writes the manifest, checks the writer fence, and renames the directory: the
commit. A rank that dies before its sidecar leaves a temp directory, never a checkpoint.
With HSDP only the first replica group writes (the others hold the same bytes).

Why not DCP's format: its ``.metadata`` is a pickle that loading unpickles (code from a
tampered checkpoint would run), and its save plans with collectives, which a writer
thread cannot make beside training's. Here no pickle is read (safetensors and a JSON
index), no collective runs after the snapshot, and a load reads only the slices a rank
needs (``safe_open``'s slices), so any world size and mesh can restore any checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.tensor import DTensor, Replicate

from elastic_train.checkpoint.snapshot import SnapshotBuffers
from elastic_train.checkpoint.storage import (
    MANIFEST,
    SHARDED,
    CheckpointInfo,
    CheckpointStore,
    build_manifest,
    check_kind,
    fsync_dir,
    is_sharded_checkpoint,
    load_payload,
    model_digest,
    step_dirname,
)
from elastic_train.checkpoint.torch_seams import dtensor_chunk
from elastic_train.errors import CheckpointCorruptError, CheckpointMismatchError, StorageError

__all__ = ["COMMON", "PART_MAGIC", "SHARDED", "EncodedShards", "Part", "SaveAbandoned",
           "ShardedSnapshot", "as_dtensor", "check_kind", "commit", "encode", "full_tensors",
           "is_sharded", "is_sharded_checkpoint", "load_state", "read_part",
           "restore_from_parts", "restore_into", "sharded_like", "snapshot", "split_state",
           "staging_dir", "state_of", "write_rank"]

COMMON = "common.pt"
MARK = "__elastic_train_sharded__"
"""Where a sharded tensor was, in ``common.pt``'s tree: ``{MARK: path}``."""
REPLICA = "elastic_train_replica"
"""The attribute of a sharded root module that holds its replica group's index (HSDP on
gloo, where the mesh FSDP2 sees is the replica group's own: worker/sharding.py); only
group 0 writes shards."""
POLL_SECONDS = 0.02
MODEL = "model"
OPTIMIZER = "optimizer"


def shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def sidecar_file(rank: int) -> str:
    return f"shard-{rank:05d}.json"


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded (FSDP2, HSDP: DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def staging_dir(root: Path, step: int, epoch: int | None, generation: int = 0) -> Path:
    """The temp directory every rank of one save writes into (the same name on each:
    ``.tmp-`` so that a restore removes it if the save never commits). The writer epoch and
    the generation of the world (live recovery) are in its name: a save of the same step by
    a later world never finds the shards of an earlier one's abandoned save."""
    return root / (f".tmp-{step_dirname(step)}-e{epoch if epoch is not None else 0}"
                   f"-g{generation}")


class SaveAbandoned(Exception):
    """Rank 0 stopped waiting for the shards of a save: the world that took it re-formed
    (live recovery) before every rank wrote its shard. The last good checkpoint stays."""


# ---- the state --------------------------------------------------------------------------
def state_of(objects: Mapping[str, Any]) -> dict[str, Any]:
    """Every object's state; the model and optimizer as torch's sharded state dicts
    (tensors keyed by their parameter's name: independent of how they are wrapped)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = objects[MODEL], objects.get(OPTIMIZER)
    model_state, optim_state = get_state_dict(model, [optimizer] if optimizer else [])
    state = {MODEL: model_state}
    if optimizer is not None:
        state[OPTIMIZER] = optim_state
    for name, obj in objects.items():
        if name not in (MODEL, OPTIMIZER):
            state[name] = obj.state_dict()
    return state


def _writes(tensor: DTensor) -> bool:
    """Whether this rank writes its part of ``tensor``: with replicas (HSDP), only the
    first replica of each part."""
    coordinate = tensor.device_mesh.get_coordinate() or []
    return all(c == 0 for c, p in zip(coordinate, tensor.placements, strict=False)
               if isinstance(p, Replicate))


@dataclass
class Part:
    """One rank's part of a sharded tensor, as the index lists it."""

    path: str
    key: str
    offset: list[int]
    shape: list[int]
    whole: list[int]
    dtype: str

    def entry(self, file: str) -> dict[str, Any]:
        return {"file": file, "key": self.key, "offset": self.offset, "shape": self.shape}


@dataclass
class ShardedSnapshot:
    """What one rank copied for a save: its parts (host tensors) and, on rank 0, the state
    that is not sharded."""

    rank: int
    world_size: int
    parts: list[Part]
    tensors: dict[str, torch.Tensor]
    common: dict[str, Any] | None


class _Tree:
    """A tree already taken from its objects, for ``SnapshotBuffers.copy`` to copy."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree

    def state_dict(self) -> dict[str, Any]:
        return self.tree

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tree = state


def split_state(state: Mapping[str, Any], keep: Callable[[DTensor], bool] = _writes
                ) -> tuple[dict[str, Any], list[Part], dict[str, torch.Tensor]]:
    """``state`` (from ``state_of``) split into the tree that is not sharded, with a marker
    where each sharded tensor was, and this rank's parts of the sharded tensors that
    ``keep`` selects (the index entries, and their local tensors by key: not copies)."""
    parts: list[Part] = []
    locals_: dict[str, torch.Tensor] = {}

    def split(value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            if keep(value):
                offset, shape = dtensor_chunk(value)
                key = f"{path}@{','.join(map(str, offset))}"
                local = value.to_local()
                if local.numel():
                    parts.append(Part(path, key, offset, shape, list(value.shape),
                                      str(value.dtype).removeprefix("torch.")))
                    locals_[key] = local
            return {MARK: path}
        if isinstance(value, dict):
            return {k: split(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(split(v, f"{path}/{i}") for i, v in enumerate(value))
        return value

    common = {name: split(value, name) for name, value in state.items()}
    return common, parts, locals_


def snapshot(objects: Mapping[str, Any], rank: int, world_size: int,
             buffers: SnapshotBuffers) -> ShardedSnapshot:
    """Copy this rank's parts (and on rank 0 the rest) into ``buffers``."""
    first_replica = int(getattr(objects[MODEL], REPLICA, 0)) == 0
    common, parts, locals_ = split_state(
        state_of(objects), _writes if first_replica else lambda _: False)
    copied = buffers.copy({"parts": _Tree(locals_),
                           "common": _Tree(common if rank == 0 else {})})
    return ShardedSnapshot(rank, world_size, parts, copied["parts"],
                           copied["common"] if rank == 0 else None)


# ---- writing ----------------------------------------------------------------------------
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


PART_MAGIC = b"ETPART02"
"""The first bytes of a part as the memory tier holds it (``EncodedShards.payloads``)."""


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


# ---- reading ----------------------------------------------------------------------------
class _Files:
    """The shard files of one checkpoint, each opened once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, Any] = {}

    def slice(self, file: str, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(str(self.root / file), framework="pt")
        return handle.get_slice(key)[region]


def _copy_overlap(target: torch.Tensor, offset: list[int], part: Mapping[str, Any],
                  read: Callable[[tuple[slice, ...]], torch.Tensor]) -> int:
    """Copy into ``target`` (the region at ``offset`` of the whole tensor) what saved
    ``part`` (its offset and shape) holds of it, read as ``read(region of the part)``; the
    elements copied (0: they do not overlap)."""
    mine, theirs = [], []
    for o, n, po, pn in zip(offset, target.shape, part["offset"], part["shape"], strict=True):
        lo, hi = max(o, po), min(o + n, po + pn)
        if lo >= hi:
            return 0
        mine.append(slice(lo - o, hi - o))
        theirs.append(slice(lo - po, hi - po))
    region = read(tuple(theirs))
    target[tuple(mine)] = region.to(target.dtype)
    return region.numel()


def _fill(target: torch.Tensor, offset: list[int], entry: Mapping[str, Any], files: _Files,
          path: str) -> None:
    """Copy into ``target`` (the region at ``offset`` of the whole tensor) every saved part
    that overlaps it; every element must be covered."""
    covered = 0
    for part in entry["parts"]:
        covered += _copy_overlap(target, offset, part,
                                 lambda region, p=part: files.slice(p["file"], p["key"], region))
    if covered != target.numel():
        raise CheckpointMismatchError(
            f"the checkpoint's parts of {path} cover {covered} of the {target.numel()} "
            "elements this rank needs: it is incomplete; it was left untouched: move it "
            "aside to resume from the one before")


def full_tensors(root: Path, index: Mapping[str, Mapping[str, Any]], prefix: str
                 ) -> dict[str, torch.Tensor]:
    """The whole tensors under ``prefix`` (``model/``), assembled from their parts (export,
    the model's digest)."""
    files, out = _Files(root), {}
    for path, entry in index.items():
        if path.startswith(prefix):
            whole = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
            _fill(whole, [0] * whole.dim(), entry, files, path)
            out[path[len(prefix):]] = whole
    return out


def sharded_like(path: str, model_state: Mapping[str, Any]) -> DTensor:
    """The sharded tensor of this job that the checkpoint's ``path`` fills: a parameter
    (``model/NAME``) or optimizer state of it (``optimizer/state/NAME/KEY``)."""
    parts = path.split("/")
    name = parts[1] if parts[0] == MODEL else parts[2] if parts[:2] == [OPTIMIZER, "state"] \
        else None
    like = model_state.get(name) if name is not None else None
    if not isinstance(like, DTensor):
        raise CheckpointMismatchError(
            f"the checkpoint holds a sharded {path} that this job's model has no sharded "
            "parameter for: use the --parallelism and model that wrote it")
    return like


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` (this rank's part of ``like``'s whole tensor) as a tensor sharded as
    ``like`` is, on its device."""
    return DTensor.from_local(local.to(like.to_local().device), like.device_mesh,
                              like.placements, shape=like.shape, stride=like.stride(),
                              run_check=False)


def load_state(objects: Mapping[str, Any], common: Mapping[str, Any],
               filled: Mapping[str, DTensor], where: str) -> None:
    """Load ``common`` (the state that is not sharded, with a marker where each sharded
    tensor was) and the sharded tensors ``filled`` (by path) into ``objects``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    def put_back(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {MARK}:
            return filled[value[MARK]]
        if isinstance(value, dict):
            return {k: put_back(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(put_back(v) for v in value)
        return value

    for name in objects:
        if name not in common:
            raise CheckpointMismatchError(f"{where} has no {name!r} state: it was written by "
                                          "another program; use a new --run-dir")
    model, optimizer = objects[MODEL], objects.get(OPTIMIZER)
    set_state_dict(model, [optimizer] if optimizer is not None else [],
                   model_state_dict=put_back(common[MODEL]),
                   optim_state_dict=put_back(common[OPTIMIZER]) if optimizer is not None
                   else {})
    for name, obj in objects.items():
        if name not in (MODEL, OPTIMIZER):
            obj.load_state_dict(common[name])


def restore_into(info: CheckpointInfo, objects: Mapping[str, Any],
                 map_location: str | torch.device) -> None:
    """Load sharded checkpoint ``info`` into ``objects`` on this rank, resharded to this
    job's mesh: every rank reads only the slices of its own parts."""
    assert info.manifest is not None
    index = info.manifest[SHARDED]["tensors"]
    common = load_payload(info.path / COMMON, info.path, map_location)
    current = state_of({MODEL: objects[MODEL]})[MODEL]
    files = _Files(Path(info.path))
    filled: dict[str, DTensor] = {}
    for path, entry in index.items():
        like = sharded_like(path, current)
        if list(like.shape) != list(entry["shape"]):
            raise CheckpointMismatchError(
                f"checkpoint {info.path} is for another model: {path} is {entry['shape']} "
                f"there and {list(like.shape)} here; use a new --run-dir")
        offset, shape = dtensor_chunk(like)
        local = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        if local.numel():
            _fill(local, offset, entry, files, path)
        filled[path] = as_dtensor(local, like)
    load_state(objects, common, filled, f"checkpoint {info.path}")


# ---- reading from the memory tier ------------------------------------------------------
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _safetensors_views(data: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes as views of ``data`` (no copy: a reader copies
    only the regions it needs)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + size]))
    body = data[8 + size:]
    out = {}
    with warnings.catch_warnings():  # read-only bytes: the views are only read
        warnings.simplefilter("ignore", UserWarning)
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            flat = torch.frombuffer(body[begin:end], dtype=dtype) if end > begin \
                else torch.empty(0, dtype=dtype)
            out[key] = flat.reshape(info["shape"])
    return out


def read_part(payload: bytes, where: str) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """A part as ``EncodedShards.payloads`` made it: (its sidecar, its files' bytes by
    name, views of ``payload``). Raises ``CheckpointCorruptError`` on anything else."""
    try:
        view = memoryview(payload)
        if bytes(view[:len(PART_MAGIC)]) != PART_MAGIC:
            raise ValueError("not a part")
        start = len(PART_MAGIC) + 8
        size = int.from_bytes(view[len(PART_MAGIC):start], "little")
        header = json.loads(bytes(view[start:start + size]))
        body = start + size
        files = {name: view[body + lo:body + hi] for name, (lo, hi) in header["spans"].items()}
        if any(hi > len(view) - body for lo, hi in header["spans"].values()):
            raise ValueError("short")
        return header["sidecar"], files
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"{where} is not a readable part of a sharded "
                                     f"checkpoint ({exc}); it was not loaded") from None


def _marked(tree: Any) -> list[str]:
    """The paths of the sharded tensors ``common.pt``'s tree marks."""
    if isinstance(tree, dict) and set(tree) == {MARK}:
        return [tree[MARK]]
    if isinstance(tree, dict):
        return [p for v in tree.values() for p in _marked(v)]
    if isinstance(tree, list | tuple):
        return [p for v in tree for p in _marked(v)]
    return []


def _nearest_first(ranks: int, model_state: Mapping[str, Any]) -> list[int]:
    """The saved ranks' parts in the order to read them: by how near each one's share is
    to this rank's (on a resize a rank's region overlaps one or two saved parts; reading
    stops once every element is in)."""
    like = next((t for t in model_state.values() if isinstance(t, DTensor) and t.dim()), None)
    mine = 0.5
    if like is not None and like.shape[0]:
        offset, shape = dtensor_chunk(like)
        mine = (offset[0] + shape[0] / 2) / like.shape[0]
    return sorted(range(ranks), key=lambda p: abs((p + 0.5) / ranks - mine))


def restore_from_parts(fetch: Callable[[int], bytes], parts: int, objects: Mapping[str, Any],
                       map_location: str | torch.device, where: str) -> int:
    """Load a sharded checkpoint held as ``parts`` parts (the memory tier's: one per saved
    rank, then the common state; ``fetch(part)`` gives one's bytes) into ``objects``,
    resharded to this job's mesh. A rank reads the common state and only the parts its
    region needs; the number of parts it read."""
    current = state_of({MODEL: objects[MODEL]})[MODEL]
    ranks = parts - 1
    _, files = read_part(fetch(ranks), f"part {ranks} of {where}")
    if COMMON not in files:
        raise CheckpointCorruptError(f"part {ranks} of {where} has no {COMMON}; it was not "
                                     "loaded")
    common = load_payload(io.BytesIO(files[COMMON]), where, map_location)
    targets: dict[str, tuple[DTensor, list[int], torch.Tensor]] = {}
    covered: dict[str, int] = {}
    for path in _marked(common):
        like = sharded_like(path, current)
        offset, shape = dtensor_chunk(like)
        targets[path] = (like, offset, torch.empty(shape, dtype=like.dtype))
        covered[path] = 0
    read = 1
    for part in _nearest_first(ranks, current):
        if all(covered[p] == targets[p][2].numel() for p in targets):
            break
        sidecar, files = read_part(fetch(part), f"part {part} of {where}")
        read += 1
        tensors = _safetensors_views(files[shard_file(part)]) if shard_file(part) in files \
            else {}
        for entry in sidecar["parts"]:
            path = entry["path"]
            if path not in targets:
                raise CheckpointMismatchError(f"{where} holds a part of {path} that its common "
                                              "state does not name: it is not one save's")
            like, offset, local = targets[path]
            if list(like.shape) != list(entry["whole"]):
                raise CheckpointMismatchError(
                    f"{where} is for another model: {path} is {entry['whole']} there and "
                    f"{list(like.shape)} here; use a new --run-dir")
            saved = tensors[entry["key"]]
            covered[path] += _copy_overlap(local, offset, entry,
                                           lambda region, t=saved: t[region])
    missing = [p for p in targets if covered[p] != targets[p][2].numel()]
    if missing:
        raise CheckpointMismatchError(
            f"the {ranks} parts of {where} cover {covered[missing[0]]} of the "
            f"{targets[missing[0]][2].numel()} elements of {missing[0]} this rank needs: they "
            "are not one complete save")
    filled = {path: as_dtensor(local, like) for path, (like, _, local) in targets.items()}
    load_state(objects, common, filled, where)
    return read
