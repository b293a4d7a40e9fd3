"""A hand-written loop's sharded model (``session.wrap(model, parallelism="fsdp"|"hsdp")``)
kept across live re-formations of the world.

FSDP2 keeps the process group of the mesh a model was sharded on, so a re-formed world
needs the model sharded again on its own mesh, as the built-in job builds its model again
(worker/sharded_recovery.py). A loop, though, holds the model and the optimizer it built,
and goes on calling them. So ``wrap`` keeps a skeleton of the model (a copy on the meta
device: its structure, no storage), and each re-formation:

1. shards a copy of the skeleton on the new mesh and allocates its shards
   (``to_empty``, as torchtitan initialises a model built on the meta device);
2. copies the buffers, which FSDP2 does not shard, from the loop's model (the state
   shared next overwrites the persistent ones);
3. points every registered optimizer's parameter groups at the new parameters, by name,
   and empties its state (the state shared next fills it);
4. makes the loop's model object that new module (torch_seams.become).

The values then come from the members that hold them, else from the newest checkpoint
(worker/sharded_recovery.py). The loop's ``model`` and ``optimizer`` stay the objects it
holds; a submodule or parameter it kept a reference to apart from them is the old world's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn

from elastic_train.worker import sharding, torch_seams
from elastic_train.worker.distributed import Group

__all__ = ["LoopShardedModel", "meta_skeleton"]


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no
    storage; tied parameters stay tied). Raises what ``copy.deepcopy`` raises for a model
    that cannot be copied."""
    memo: dict[int, object] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


class LoopShardedModel:
    """The loop's sharded model and how it is sharded again on a new world's mesh."""

    def __init__(self, model: nn.Module, parallelism: str, replica_group_size: int,
                 collective: Callable[..., None] | None, *, rebuildable: bool) -> None:
        """``collective``: how FSDP2's waited collectives run (sharding.shard_model);
        ``rebuildable``: keep a skeleton so that ``rebuild`` can shard the model again
        (live recovery); ``not_rebuildable`` then says why not, if it cannot be."""
        self.parallelism = parallelism
        self.replica_group_size = replica_group_size
        self.collective = collective
        self.skeleton: nn.Module | None = None
        self.not_rebuildable: str | None = None
        if rebuildable:
            try:
                self.skeleton = meta_skeleton(model)
            except Exception as exc:  # an attribute deepcopy refuses (a lock, a file)
                self.not_rebuildable = (f"the model cannot be copied to the meta device "
                                        f"({type(exc).__name__}: {exc})")
        self.model = model

    def shard(self, group: Group) -> nn.Module:
        """Shard the model on ``group``'s mesh, in place (the first world)."""
        self.model = sharding.shard_model(self.model.to(group.device), group,
                                          self.parallelism, self.replica_group_size,
                                          self.collective)
        return self.model

    def rebuild(self, group: Group, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The model sharded again on ``group``'s mesh, in the same object, with
        ``optimizers`` pointed at its new parameters (their state emptied); the values of
        the parameters and of that state are for the caller to load."""
        assert self.skeleton is not None, self.not_rebuildable
        fresh = sharding.shard_model(copy.deepcopy(self.skeleton), group, self.parallelism,
                                     self.replica_group_size, self.collective)
        fresh.to_empty(device=group.device)
        with torch.no_grad():
            old_buffers = dict(self.model.named_buffers())
            for name, buffer in fresh.named_buffers():
                if name in old_buffers:
                    buffer.copy_(old_buffers[name])
        names = {id(p): name for name, p in self.model.named_parameters()}
        new = dict(fresh.named_parameters())
        for optimizer in optimizers:
            for param_group in optimizer.param_groups:
                param_group["params"] = [new[names[id(p)]] if id(p) in names else p
                                         for p in param_group["params"]]
            optimizer.state.clear()
        torch_seams.become(self.model, fresh)
