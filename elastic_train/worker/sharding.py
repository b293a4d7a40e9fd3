"""Sharded data parallelism (``--parallelism fsdp|hsdp``): the model wrapped by FSDP2's
``fully_shard`` on a device mesh of this world, block by block.

- ``fsdp``: every parameter, its gradient and its optimizer state sharded over all ranks
  (a 1-D mesh); what one rank holds is about 1/world of DDP's.
- ``hsdp``: sharded within replica groups of ``--replica-group-size`` ranks, replicated
  across the groups (a 2-D mesh: replicate x shard): gradients are reduce-scattered in a
  group and all-reduced across groups.

The units of sharding are the modules of every ``nn.ModuleList`` in the model (the GPT
task's blocks; a user's transformer layers), then the root for the rest. A unit's
parameters are gathered for its forward and backward and freed after; the gradients are
averaged over the data-parallel ranks as DDP's are, so the trainer's loss weighting holds.
Checkpoints of a sharded model are sharded too (checkpoint/sharded.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from elastic_train.config import mesh_shape
from elastic_train.worker.distributed import Group

__all__ = ["gradient_sync", "shard_model", "shard_units"]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: every module of every ``nn.ModuleList``."""
    return [unit for module in model.modules() if isinstance(module, nn.ModuleList)
            for unit in module]


def shard_model(model: nn.Module, group: Group, parallelism: str,
                replica_group_size: int = 0) -> nn.Module:
    """Wrap ``model`` (on ``group.device``) with FSDP2 over this world, in place; the
    optimizer must be built after this (it takes the sharded parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = mesh_shape(parallelism, group.world_size, replica_group_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(group.device.type, shape, mesh_dim_names=names)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """A micro-batch whose gradients are only accumulated (``enabled`` False), as DDP's
    ``no_sync``: FSDP2 reduces them with the last micro-batch's."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None or enabled:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
