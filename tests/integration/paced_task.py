"""The built-in GPT task with a floor on the time of a step, for multi-node tests.

A resize test kills a node, waits for the smaller world, then starts a node and waits
for the job to grow: the job must still be training by then, however fast the machine
trains and however slowly it starts processes. ``pace=SECONDS`` makes every forward pass
take at least that long; ``pace_world_N=SECONDS`` does so only while the world size is N
(slow steps in the small world leave the new node time to join; the other phases run at
full speed). Everything else — model, data, optimizer, loss — is the real GPT task
(``--task tests.integration.paced_task:make_task``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.gpt import GPTTask
from elastic_train.tasks.gpt import make_task as make_gpt_task


class PacedTask:
    """Delegates to the GPT task; ``loss`` takes at least the pace of the world size."""

    def __init__(self, inner: GPTTask, pace: float, per_world: dict[int, float]) -> None:
        self.inner = inner
        self.pace = pace
        self.per_world = per_world

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def build_dataset(self) -> Any:
        return self.inner.build_dataset()

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return self.inner.build_optimizer(model, lr)

    def collate(self, samples: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner.collate(samples)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        started = time.monotonic()
        value = self.inner.loss(model, batch)
        world = dist.get_world_size() if dist.is_initialized() else 1
        pace = self.per_world.get(world, self.pace)
        time.sleep(max(0.0, pace - (time.monotonic() - started)))
        return value


def make_task(ctx: TaskContext) -> PacedTask:
    options = dict(ctx.options)
    pace = float(options.pop("pace", 0.0))
    per_world = {int(key.rsplit("_", 1)[1]): float(options.pop(key))
                 for key in list(options) if key.startswith("pace_world_")}
    return PacedTask(make_gpt_task(TaskContext(options, ctx.seed, ctx.run_dir)), pace,
                     per_world)
