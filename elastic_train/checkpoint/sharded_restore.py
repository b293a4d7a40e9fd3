"""A sharded checkpoint read back (the layout: sharded.py), resharded to this job's mesh: from
its files (each rank reads only the slices of its own region) or from the memory tier's
parts (a rank fetches only the parts its region overlaps)."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from elastic_train.checkpoint.sharded import (
    COMMON,
    MARK,
    MODEL,
    OPTIMIZER,
    PART_MAGIC,
    shard_file,
    state_of,
)
from elastic_train.checkpoint.storage import SHARDED, CheckpointInfo, load_payload
from elastic_train.checkpoint.torch_seams import dtensor_chunk
from elastic_train.errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = ["as_dtensor", "full_tensors", "load_state", "read_part", "restore_from_parts",
           "restore_into", "sharded_like"]


# ---- from the checkpoint's files ------------------------------------------------------
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
