"""Live recovery of a sharded model (``--parallelism fsdp|hsdp``): the survivors keep their
processes, the model is sharded again on the new world's mesh, and its state comes from the
members that hold it, else from the newest checkpoint.

A re-formed world has a new process group, and FSDP2 keeps the group of the mesh it was
built on, so every member builds its model, optimizer and scheduler again on the new mesh
(``rebuild``: the trainer's; a process, its imports, its CUDA context and its data stay).
What each survivor held before is kept aside first (``hold``: its local parts of every
sharded tensor, no copy, and the state that is not sharded). Then, over the new group:

1. every member says which parts it holds at the newest step (one small JSON each);
2. if those parts cover every sharded tensor (HSDP: a lost rank's replica group peers hold
   its parts; a node joined: every part survived), each rank fills its part in the new mesh
   from them, **in place**: its own parts where it holds them, the rest broadcast by the
   lowest rank holding each (only the parts someone lacks, one broadcast per sender);
3. else (FSDP has no replica: a lost rank's parts are gone) every member loads the newest
   checkpoint, resharded to the new mesh, **through the checkpoint**: every rank goes back
   to that step, as a restart would, but without one.

The state that is not sharded (the optimizer's step counts and param groups, the scheduler,
the sampler, the trainer's counters) comes from the lowest rank holding the newest step.
Every rank ends with the state the uninterrupted run had at that step, so a recovery at the
same world size changes no bit of the result (the step in flight, or the steps after the
checkpoint, are redone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastic_train.checkpoint import sharded, sharded_restore
from elastic_train.checkpoint.manager import Restored, Stateful
from elastic_train.checkpoint.torch_seams import dtensor_chunk
from elastic_train.errors import LiveRecoveryError
from elastic_train.worker import distributed
from elastic_train.worker.distributed import Group

__all__ = ["Holding", "ShardedLive", "Shared", "hold", "share"]


@dataclass
class Holding:
    """What one survivor held when its world re-formed: its local parts of the sharded
    tensors (by path; the tensors themselves, not copies) and the rest of the state."""

    common: dict[str, Any]
    parts: dict[str, tuple[list[int], torch.Tensor]]
    """path -> (offset in the whole tensor, this rank's part)"""
    wholes: dict[str, tuple[list[int], str]]
    """path -> (whole shape, dtype) of every sharded tensor, parts held here or not"""


@dataclass
class ShardedLive:
    """A sharded member's side of a re-formation: what it held (None: a worker started into
    the world, which holds nothing) and how it builds its objects on the new mesh."""

    holding: Holding | None
    rebuild: Callable[[], Mapping[str, Stateful]]


@dataclass(frozen=True)
class Shared:
    """How the members came to the same state."""

    step: int
    bytes: int
    source_rank: int
    from_checkpoint: bool
    """True: the parts did not cover the model; every member loaded the newest checkpoint."""


def _reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state: a step that failed in its forward
    or backward may have left some unsharded (their parameters gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def hold(objects: Mapping[str, Stateful]) -> Holding:
    """This survivor's state, kept aside before its model is built again."""
    _reshard(objects[sharded.MODEL])  # type: ignore[arg-type]
    state = sharded.state_of(objects)
    common, _, _ = sharded.split_state(state, keep=lambda _: False)
    parts: dict[str, tuple[list[int], torch.Tensor]] = {}
    wholes: dict[str, tuple[list[int], str]] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, DTensor):
            offset, _ = dtensor_chunk(value)
            wholes[path] = (list(value.shape), str(value.dtype).removeprefix("torch."))
            local = value.to_local()
            if local.numel():
                parts[path] = (offset, local)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}")

    for name in (sharded.MODEL, sharded.OPTIMIZER):
        walk(state.get(name), name)
    return Holding(common, parts, wholes)


def _overlap(offset: list[int], shape: list[int] | torch.Size, other_offset: list[int],
             other_shape: list[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where region (``offset``, ``shape``) and the other overlap: (slices of the first,
    slices of the other), or None."""
    mine, theirs = [], []
    for o, n, po, pn in zip(offset, shape, other_offset, other_shape, strict=True):
        lo, hi = max(o, po), min(o + n, po + pn)
        if lo >= hi:
            return None
        mine.append(slice(lo - o, hi - o))
        theirs.append(slice(lo - po, hi - po))
    return tuple(mine), tuple(theirs)


def share(group: Group, objects: Mapping[str, Stateful], holding: Holding | None,
          held: list[int], newest: int, restore: Callable[[], Restored | None]) -> Shared:
    """Every member of the re-formed world (``objects`` built on its mesh): bring every
    rank to one state. ``held``: the step each rank's ``holding`` is at (-1: none);
    ``restore``: loads the newest checkpoint into ``objects`` on every rank."""
    rank, world = group.rank, group.world_size
    mine = holding if holding is not None and held[rank] == newest else None
    said = {"wholes": mine.wholes if mine else {},
            "parts": {path: [offset, list(local.shape)]
                      for path, (offset, local) in mine.parts.items()} if mine else {}}
    described = [distributed.broadcast_json(group, said if r == rank else None, r)
                 for r in range(world)]
    wholes: dict[str, tuple[list[int], str]] = {}
    # every distinct part at the newest step: (path, offset) -> (shape, lowest rank holding it)
    chosen: dict[tuple[str, tuple[int, ...]], tuple[list[int], int]] = {}
    for r, description in enumerate(described):
        wholes.update({p: (w[0], w[1]) for p, w in description["wholes"].items()})
        for path, (offset, shape) in description["parts"].items():
            chosen.setdefault((path, tuple(offset)), (shape, r))
    covered = {path: 0 for path in wholes}
    for (path, _), (shape, _) in chosen.items():
        covered[path] += math.prod(shape)
    if not wholes or any(n != math.prod(wholes[p][0]) for p, n in covered.items()):
        restored = restore()
        if restored is None:
            raise LiveRecoveryError(
                "the members left hold only some shards of the model and no checkpoint "
                "holds the rest; the job restarts from the beginning")
        return Shared(restored.step, 0, -1, from_checkpoint=True)

    current = sharded.state_of({sharded.MODEL: objects[sharded.MODEL]})[sharded.MODEL]
    order = sorted(chosen)
    regions: dict[str, tuple[list[int], list[int]]] = {}
    locals_: dict[str, torch.Tensor] = {}

    def put(path: str, offset: list[int], part: torch.Tensor) -> None:
        """Fill this rank's region of ``path`` from ``part`` (at ``offset``): a part that
        is exactly the region is taken as it is, with no copy."""
        region, shape = regions[path]
        if region == offset and shape == list(part.shape) and path not in locals_:
            locals_[path] = part
            return
        if path not in locals_:
            locals_[path] = torch.empty(shape, dtype=getattr(torch, wholes[path][1]))
        overlap = _overlap(region, shape, offset, list(part.shape))
        assert overlap is not None
        locals_[path][overlap[0]] = part[overlap[1]]

    needed = torch.zeros(len(order), dtype=torch.float64, device=group.device)
    for i, (path, offset) in enumerate(order):
        if path not in regions:
            regions[path] = dtensor_chunk(sharded_restore.sharded_like(path, current))
        shape, _ = chosen[(path, offset)]
        if _overlap(*regions[path], list(offset), shape) is None:
            continue
        own = mine.parts.get(path) if mine else None
        if own is not None and tuple(own[0]) == offset and list(own[1].shape) == shape:
            put(path, list(offset), own[1])
        else:
            needed[i] = 1.0
    wanted = distributed.sum_over_ranks(group, needed.clone())  # in place: a copy
    sent = 0
    for source in range(world):
        keys = [i for i, key in enumerate(order) if wanted[i] and chosen[key][1] == source]
        if not keys:
            continue
        payload = {str(i): mine.parts[order[i][0]][1] for i in keys} \
            if rank == source and mine else None
        # views of the received buffer: put() copies only what it needs of them
        received, nbytes = distributed.broadcast_state(group, payload, source, copy=False)
        sent += nbytes
        for name, part in (received or {}).items():
            i = int(name)
            if needed[i]:
                put(order[i][0], list(order[i][1]), part)
    for path, (_, shape) in regions.items():  # a region no part overlaps: nothing to fill
        if path not in locals_:
            locals_[path] = torch.empty(shape, dtype=getattr(torch, wholes[path][1]))

    source = held.index(newest)
    common = mine.common if mine else None
    if any(h < newest for h in held):
        received_common, nbytes = distributed.broadcast_state(
            group, mine.common if rank == source and mine else None, source)
        sent += nbytes
        if common is None:
            assert received_common is not None
            common = received_common
    assert common is not None
    filled = {path: sharded_restore.as_dtensor(local, sharded_restore.sharded_like(path, current))
              for path, local in locals_.items()}
    sharded_restore.load_state(objects, common, filled, f"the state rank {source} sent")
    return Shared(newest, sent, source, from_checkpoint=False)
