"""The Task protocol: what a training job needs from user code.

A task is built by a factory ``factory(ctx: TaskContext) -> Task`` that ``--task
package.module:factory`` names. The trainer owns everything else: the process group, DDP,
data order, gradient accumulation, LR schedule, clipping, checkpoints and resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

OptionValue = str | int | float | bool


@dataclass(frozen=True)
class TaskContext:
    """What a task factory is given.

    ``options`` are the task's own options (``--task-opt KEY=VALUE`` on the command line,
    ``[task_options]`` in a config file); values from the command line arrive as strings.
    A factory must reject keys it does not know with a ``ConfigError``.
    """

    options: Mapping[str, OptionValue] = field(default_factory=dict)
    seed: int = 0
    run_dir: Path = Path(".")


@runtime_checkable
class Task(Protocol):
    """A model, its data, its optimizer and its loss.

    Requirements that make exact resume possible:
    - ``build_model`` is deterministic given the global torch seed the trainer sets first;
    - ``build_dataset`` returns a map-style dataset (``len`` and ``ds[i]``) whose item ``i``
      is always the same sample: the trainer's sampler decides the order;
    - ``loss`` returns the mean loss over the batch as a scalar tensor and draws any
      randomness (dropout) from torch's global generator, which the trainer seeds from
      (seed, step, rank) before every step.
    """

    def build_model(self) -> nn.Module: ...

    def build_dataset(self) -> Any: ...

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...


def collate(task: Task, samples: Sequence[Any]) -> Any:
    """Batch ``samples`` with the task's own ``collate`` if it has one, else torch's default."""
    own = getattr(task, "collate", None)
    if own is not None:
        return own(samples)
    from torch.utils.data import default_collate

    return default_collate(list(samples))
