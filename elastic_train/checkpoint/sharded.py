"""Sharded checkpoints (``--parallelism fsdp|hsdp``): every rank writes its own shards, rank 0
commits them, and any world size or mesh reads them back resharded. This module: the layout,
the state and its snapshot; the writing and the commit: sharded_save.py; the reading back:
sharded_restore.py.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from elastic_train.checkpoint.snapshot import SnapshotBuffers
from elastic_train.checkpoint.storage import step_dirname
from elastic_train.checkpoint.torch_seams import dtensor_chunk

__all__ = ["COMMON", "MARK", "MODEL", "OPTIMIZER", "PART_MAGIC", "REPLICA", "Part",
           "ShardedSnapshot", "is_sharded", "shard_file", "sidecar_file", "snapshot",
           "split_state", "staging_dir", "state_of"]

COMMON = "common.pt"
MARK = "__elastic_train_sharded__"
"""Where a sharded tensor was, in ``common.pt``'s tree: ``{MARK: path}``."""
REPLICA = "elastic_train_replica"
"""The attribute of a sharded root module that holds its replica group's index (HSDP on
gloo, where the mesh FSDP2 sees is the replica group's own: worker/sharding.py); only
group 0 writes shards."""
MODEL = "model"
OPTIMIZER = "optimizer"
PART_MAGIC = b"ETPART02"
"""The first bytes of a part as the memory tier holds it
(``sharded_save.EncodedShards.payloads``)."""


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
