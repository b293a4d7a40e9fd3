"""What ``ElasticSession`` changes in a hand-written loop's own objects: a step whose
gradient all-reduce failed (a peer was lost; live recovery redoes it) must change nothing,
and a hand-written loop has no commit point to skip it, so its optimizer, LR scheduler and
GradScaler are gated (``skip_failed_steps``). Nothing else of the user's objects changes:
their state dicts, classes' names and the calls torch's LR schedulers count stay as they
were.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from elastic_train.worker import torch_seams
from elastic_train.worker.data_parallel import StepFailures

__all__ = ["skip_failed_steps"]


def skip_failed_steps(obj: Any, failures: StepFailures) -> None:
    """Make ``obj`` change nothing in a step whose gradient all-reduce failed (``failures``
    holds its error): its gradients are not the step's. An optimizer's and an LR
    scheduler's ``step()`` do nothing; a GradScaler's ``update()`` keeps its scale and
    growth count (and still clears the step's records). Any other object is left alone."""
    if isinstance(obj, torch.optim.Optimizer):
        step = obj.step

        def gated_step(target: Any, *args: Any, **kwargs: Any) -> Any:
            return None if failures.error is not None else step(*args, **kwargs)

        torch_seams.keep_lr_scheduler_mark(step, gated_step)  # an LR scheduler's
        # A bound method, as torch's LR schedulers expect of optimizer.step when they
        # wrap it to count the calls.
        obj.step = types.MethodType(gated_step, obj)
    elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        base = type(obj)

        def gated_scheduler_step(target: Any, *args: Any, **kwargs: Any) -> Any:
            return None if failures.error is not None \
                else base.step(target, *args, **kwargs)

        # Its state_dict() is its __dict__: the gate goes in a subclass, not the instance.
        obj.__class__ = type(base.__name__, (base,), {
            "step": gated_scheduler_step, "__module__": base.__module__,
            "__qualname__": base.__qualname__})
    elif isinstance(obj, torch.amp.GradScaler):
        update = obj.update

        def gated_update(target: Any, new_scale: Any = None) -> None:
            if failures.error is not None:
                new_scale = target.get_scale()  # as it was: no growth, no back-off
            update(new_scale)

        obj.update = types.MethodType(gated_update, obj)
