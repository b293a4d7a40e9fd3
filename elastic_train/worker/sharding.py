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
from collections.abc import Callable, Iterator

from torch import nn

from elastic_train.checkpoint.sharded import REPLICA
from elastic_train.config import mesh_shape
from elastic_train.worker.distributed import Group

__all__ = ["gradient_sync", "shard_model", "shard_units"]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: every module of every ``nn.ModuleList``."""
    return [unit for module in model.modules() if isinstance(module, nn.ModuleList)
            for unit in module]


def shard_model(model: nn.Module, group: Group, parallelism: str,
                replica_group_size: int = 0, collective: Callable[..., None] | None = None
                ) -> nn.Module:
    """Wrap ``model`` (on ``group.device``) with FSDP2 over this world, in place; the
    optimizer must be built after this (it takes the sharded parameters).

    On gloo every collective of the sharded model is one a lost peer ends at once, as DDP's
    gradient all-reduce is (data_parallel.py): gloo's own wait would sit out the collective
    timeout, also for a peer that is alive but left for a re-formed world (live recovery).
    So FSDP2's all-gathers and reduce-scatters wait through aborts.wait, and HSDP is FSDP2
    on the replica group's own mesh with the all-reduce across the groups done by us (its
    all-reduce hook). On NCCL, whose abort ends a collective, HSDP is FSDP2's own, on the
    2-D mesh. Both average the gradients over every data-parallel rank.

    ``collective``: how those waited collectives run (data_parallel.waited_collective,
    the default; a hand-written loop's session gives a forgiving one).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    shape = mesh_shape(parallelism, group.world_size, replica_group_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(group.device.type, shape, mesh_dim_names=names)
    waited = group.backend == "gloo"
    if waited and len(shape) == 2:
        sharded_on, across = mesh["shard"], mesh.get_group("replicate")
        setattr(model, REPLICA, mesh.get_coordinate()[0])  # type: ignore[index]
    else:
        sharded_on, across = mesh, None
    for unit in shard_units(model):
        fully_shard(unit, mesh=sharded_on)
    fully_shard(model, mesh=sharded_on)
    if waited:
        from elastic_train.worker import data_parallel, torch_seams

        run = collective or data_parallel.waited_collective
        for module in model.modules():
            if isinstance(module, FSDPModule):
                all_gather, reduce_scatter = torch_seams.fsdp_comms(run)
                module.set_custom_all_gather(all_gather)
                module.set_custom_reduce_scatter(reduce_scatter)
                if across is not None:
                    module.set_all_reduce_hook(
                        data_parallel.mean_across_replicas(across, shape[0], run))
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
