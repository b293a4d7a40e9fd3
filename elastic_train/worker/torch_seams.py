"""Every private name of torch the worker side uses, and every replacement of a torch global
it makes, in one place (``REQUIRED`` declares them; tests/unit/test_torch_seams.py checks
that the installed torch still has each, with the signature used here).

The rest of the worker calls these functions, never torch's private names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.torch_private import Private

__all__ = ["REQUIRED", "become", "default_store", "destroy_process_group_preceded_by",
           "fsdp_comms",
           "group_shutdown_skipped", "groups_of_this_process", "keep_lr_scheduler_mark",
           "remove_gradient_hooks", "renew_reducer", "reset_group_count",
           "tensor_use_count"]

_DDP = "torch.nn.parallel.distributed"
_C10D = "torch.distributed.distributed_c10d"
_FSDP_API = "torch.distributed.fsdp._fully_shard._fsdp_api"
REQUIRED: tuple[Private, ...] = (
    Private(_DDP, "DistributedDataParallel._build_params_for_reducer",
            "to build a new reducer on a re-formed world (renew_reducer)", params=()),
    Private(_DDP, "DistributedDataParallel._ddp_init_helper", "(renew_reducer)",
            params=("parameters", "expect_sparse_gradient", "param_to_name_mapping",
                    "static_graph")),
    Private(_DDP, "DistributedDataParallel._build_debug_param_to_name_mapping",
            "(renew_reducer)", params=("parameters",)),
    Private(_DDP, "DistributedDataParallel._has_rebuilt_buckets",
            "to rebuild the buckets in the re-formed world's first step (renew_reducer)"),
    Private(_DDP, "DistributedDataParallel._comm_hooks",
            "to register the comm hooks again on the new reducer (renew_reducer)"),
    Private("torch._C._distributed_c10d", "Reducer._remove_autograd_hooks",
            "to detach the old world's reducer from the parameters (remove_gradient_hooks)"),
    Private("torch._C._distributed_c10d", "Reducer._set_static_graph", "(renew_reducer)"),
    Private("torch._C._distributed_c10d", "Logger._set_static_graph", "(renew_reducer)"),
    Private("torch._C._distributed_c10d", "Logger._set_comm_hook_name", "(renew_reducer)"),
    Private("torch.distributed", "_register_comm_hook", "(renew_reducer)"),
    Private(_C10D, "_get_default_store", "for the store of the default group (default_store)",
            params=()),
    Private(_C10D, "_world", "for the groups of this process and their count "
            "(groups_of_this_process, reset_group_count)"),
    Private(_C10D, "_World.pg_map", "(groups_of_this_process)"),
    Private(_C10D, "_World.group_count", "(reset_group_count)"),
    Private(_C10D, "destroy_process_group", "wrapped in a user's script "
            "(destroy_process_group_preceded_by)", params=("group",)),
    Private("torch.distributed", "ProcessGroup.shutdown", "replaced while a group with stuck "
            "work is dropped (group_shutdown_skipped)"),
    Private("torch", "Tensor._use_count", "to tell when no work of the backend holds a "
            "tensor any more (tensor_use_count)"),
    Private(_FSDP_API, "AllGather.__call__", "FSDP2's all-gather protocol, for one whose "
            "wait a lost peer ends (fsdp_comms)",
            params=("output_tensor", "input_tensor", "group", "async_op")),
    Private(_FSDP_API, "ReduceScatter.__call__", "FSDP2's reduce-scatter protocol "
            "(fsdp_comms)", params=("output_tensor", "input_tensor", "group", "op",
                                    "async_op")),
    Private(_FSDP_API, "Comm.allocate", "(fsdp_comms)", params=("size", "dtype", "device")),
    Private("torch.distributed.fsdp._fully_shard._fully_shard", "cls_to_fsdp_cls",
            "one FSDP class per module class, so that a module sharded again on a new mesh "
            "can take over the old one's object (become)"),
    Private("torch.distributed._composable_state", "_module_state_mapping",
            "the composable APIs' module -> state map (a weak reference per module), "
            "pointed at the new state when a module takes over another (become)"),
)


def fsdp_comms(run: Callable[..., None]) -> tuple[Any, Any]:
    """An all-gather and a reduce-scatter for FSDP2 (``FSDPModule.set_custom_all_gather``
    and ``set_custom_reduce_scatter`` take them) that hand torch's own collectives to
    ``run(launch, *tensors)``: ``launch()`` starts the collective (its Work), which was
    given ``tensors``. ``run`` waits for it where a lost peer ends the wait at once
    (data_parallel.waited_collective; gloo's own wait would sit out the timeout) or, in
    a hand-written loop, records a failure instead of raising it
    (data_parallel.forgiving_collective)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    # torch 2.13 named FSDP2's collectives all_gather_single and reduce_scatter_single; 2.11
    # and 2.12 have them, with the same arguments, as all_gather_into_tensor and
    # reduce_scatter_tensor (docs/torch-versions.md)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def allocate(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    class WaitedAllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
            return allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> None:
            run(lambda: all_gather(output_tensor, input_tensor, group=group, async_op=True),
                output_tensor, input_tensor)

    class WaitedReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
            return allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
            run(lambda: reduce_scatter(output_tensor, input_tensor, op=op, group=group,
                                       async_op=True), output_tensor, input_tensor)

    return WaitedAllGather(), WaitedReduceScatter()


def become(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Make ``target`` (a loop's sharded model, which it holds) the module ``source`` (the
    same model sharded again on a re-formed world's mesh): from now on both names are one
    module, ``source``'s parameters, buffers, submodules and FSDP2 state.

    FSDP2 keeps a module's state in the module's ``__dict__`` (its composable-API state
    and registry, its hooks) and gives each module class one FSDP subclass
    (``cls_to_fsdp_cls``), so ``target`` takes ``source``'s class and shares its
    ``__dict__`` (shared, not copied: what FSDP2 sets on ``source`` later is seen through
    ``target`` too). What ``target`` held before (the old mesh's state) is dropped.

    torch also maps each module to a weak reference of its state, outside the module
    (``_composable_state._module_state_mapping``, which FSDP's traversal reads, e.g. in
    ``get_state_dict``): ``target``'s entry is pointed at ``source``'s state, else it would
    name the dropped state, which fails with "State has already been garbage collected"
    once a garbage collection frees it.
    tests/unit/test_loop_sharding.py trains through it and compares with a fresh model."""
    from torch.distributed import _composable_state

    if type(target) is not type(source):
        target.__class__ = type(source)
    target.__dict__ = source.__dict__
    states = _composable_state._module_state_mapping
    states.pop(target, None)
    if source in states:
        states[target] = states[source]


def renew_reducer(ddp: DistributedDataParallel, group: dist.ProcessGroup) -> None:
    """Give ``ddp`` a new reducer on ``group``, as DDP builds one when it is unpickled (its
    ``__setstate__``), with its comm hooks registered again (data_parallel.renew_ddp says why)."""
    remove_gradient_hooks(ddp)
    ddp.process_group = group
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(parameters, expect_sparse_gradient,
                         ddp._build_debug_param_to_name_mapping(parameters), ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._has_rebuilt_buckets = False
    for hook, state in ddp._comm_hooks:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many holders ``tensor``'s storage has in C++ (a work of the backend is one)."""
    return tensor._use_count()


def remove_gradient_hooks(ddp: DistributedDataParallel) -> None:
    """Detach ``ddp``'s reducer from the parameters now (its world is gone), not when a
    garbage collection finds it."""
    ddp.reducer._remove_autograd_hooks()


def default_store() -> dist.Store | None:
    """The store the default group was formed on, if torch exposes it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def groups_of_this_process() -> list[dist.ProcessGroup] | None:
    """Every group of this process (torch's group map); None if torch hides it."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return list(pg_map) if isinstance(pg_map, Mapping) else None


def reset_group_count() -> None:
    """Forget a group that failed to form: it still counted itself, and the next one would
    take its store keys under another index than a worker starting afresh."""
    dist.distributed_c10d._world.group_count = 0


@contextlib.contextmanager
def group_shutdown_skipped() -> Iterator[None]:
    """While the block runs, ``ProcessGroup.shutdown`` does nothing: a group with stuck work
    is destroyed without joining that work (aborts.abandon_group)."""
    shutdown = dist.ProcessGroup.__dict__["shutdown"]  # the descriptor, to put back as is
    dist.ProcessGroup.shutdown = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        dist.ProcessGroup.shutdown = shutdown  # type: ignore[method-assign]


@contextlib.contextmanager
def destroy_process_group_preceded_by(
        before: Callable[[dist.ProcessGroup | None], None]) -> Iterator[None]:
    """While the block runs, ``destroy_process_group(group)`` calls ``before(group)`` first
    (in ``torch.distributed`` and in ``distributed_c10d``, where scripts may find it)."""
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group

    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        before(group)
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = c10d.destroy_process_group = original


def keep_lr_scheduler_mark(original: Any, replacement: Any) -> None:
    """Carry an LR scheduler's mark on ``optimizer.step`` (it wraps the step to count the
    calls) over to the step that replaces it, so the scheduler does not warn."""
    if hasattr(original, "_wrapped_by_lr_sched"):
        replacement._wrapped_by_lr_sched = True
