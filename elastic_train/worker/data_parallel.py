"""DDP's side of a world that re-forms in place: gradient all-reduce hooks that an abort
ends at once, and a DDP moved to the new process group; and HSDP's all-reduce across its
replica groups, with the same abortable wait.

The hooks' all-reduce is the one collective outside distributed.py: it is the gradient
reduction of DDP and HSDP, made here so that its wait is abortable (aborts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker import aborts, torch_seams

__all__ = ["StepFailures", "abortable_allreduce_hook", "forgiving_allreduce_hook",
           "forgiving_collective", "mean_across_replicas", "renew_ddp", "waited_collective"]


def abortable_allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: the default gradient mean, through an abortable future.

    Scales by ``1 / world`` before summing, as DDP's built-in path does, so the gradients
    are bit for bit those of DDP without a hook.
    """
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return aborts.abortable(work.get_future()).then(lambda fut: fut.value()[0])


class StepFailures:
    """The first collective failure of the step in flight, as a forgiving collective saw
    it (ElasticSession: DDP's ``forgiving_allreduce_hook``, a sharded model's
    ``forgiving_collective``)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def take(self) -> BaseException | None:
        """The failure of the step in flight (None: it had none), and forget it."""
        error, self.error = self.error, None
        return error


def waited_collective(launch: Callable[[], dist.Work | None], *tensors: torch.Tensor
                      ) -> None:
    """Start a collective (``launch``; it was given ``tensors``) and wait for it through an
    abortable future (aborts.wait): a lost peer ends the wait at once, with an error."""
    aborts.wait(launch(), *tensors)


def forgiving_collective(failures: StepFailures) -> Callable[..., None]:
    """``waited_collective``, but a failure is recorded in ``failures`` instead of raised,
    and once the step has one (or the world is being left) no collective starts: its
    output tensor is zeroed instead. A hand-written loop's forward and ``backward()`` over
    a sharded model then return; the session skips the optimizer step and re-forms the
    world (worker/session.py), as ``forgiving_allreduce_hook`` does for DDP."""

    def run(launch: Callable[[], dist.Work | None], *tensors: torch.Tensor) -> None:
        if failures.error is not None or aborts.aborted() is not None:
            if tensors:  # the step is void: what it computes is never applied
                tensors[0].zero_()
            failures.error = failures.error or aborts.CollectiveAborted(
                aborts.aborted() or "aborted")
            return
        try:
            aborts.wait(launch(), *tensors)
        except Exception as exc:  # a lost peer, or the group already failed
            failures.error = failures.error or exc.with_traceback(None)

    return run


def mean_across_replicas(replicas: dist.ProcessGroup, count: int,
                         run: Callable[..., None] = waited_collective
                         ) -> Callable[[torch.Tensor], None]:
    """HSDP's all-reduce hook (FSDP2's ``set_all_reduce_hook``, worker/sharding.py): a
    replica group's reduced gradient shard averaged over the ``count`` groups, run by
    ``run`` (``waited_collective`` or a ``forgiving_collective``)."""

    def hook(gradient: torch.Tensor) -> None:
        run(lambda: dist.all_reduce(gradient, group=replicas, async_op=True), gradient)
        gradient.div_(count)

    return hook


# DDP checks a hook's annotations against the types themselves, not their names.
abortable_allreduce_hook.__annotations__ = {
    "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def forgiving_allreduce_hook(state: StepFailures, bucket: dist.GradBucket
                             ) -> torch.futures.Future:
    """DDP communication hook: ``abortable_allreduce_hook``'s gradient mean, but a failed or
    aborted all-reduce is recorded in ``state`` instead of raised, so that a hand-written
    loop's ``backward()`` returns; the session then skips the optimizer step (its grads
    are garbage) and re-forms the world (worker/session.py)."""
    buffer = bucket.buffer()

    def settle(result: torch.futures.Future) -> torch.Tensor:
        try:
            return result.value()[0]
        except Exception as exc:
            state.error = state.error or exc.with_traceback(None)
            return buffer

    try:
        if aborts.aborted() is not None:  # no collective on a world that is being left: its work
            # would outlive the step, and a gloo group freed while its thread still ends
            # that work deadlocks on the GIL (seen in a test that dropped such a group)
            raise aborts.CollectiveAborted(aborts.aborted() or "aborted")
        buffer.mul_(1.0 / dist.get_world_size())
        work = dist.all_reduce(buffer, async_op=True)
    except Exception as exc:  # the group already failed (aborted, or its peer is gone)
        state.error = state.error or exc
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_result(buffer)
        return failed
    return aborts.abortable(work.get_future()).then(settle)


forgiving_allreduce_hook.__annotations__ = {
    "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

def renew_ddp(ddp: DistributedDataParallel) -> None:
    """Move ``ddp`` to this process' new default group (the world re-formed in place) with
    a new reducer, as DDP builds one when it is unpickled (its ``__setstate__``).

    Not ``DDP._update_process_group``: that keeps the buckets rebuilt in the first
    iteration, in the order the gradients came, while a DDP built anew in a worker that
    joins starts with the default order; the two would reduce different parameters' slots
    together. Every member renews, so every member's buckets are the same. The comm hooks
    registered before are registered again.
    """
    torch_seams.renew_reducer(ddp, dist.group.WORLD)
