"""Bring your own model: a Task for ``--task examples.custom_task:make_task``.

    elastic-train run --task examples.custom_task:make_task --task-opt hidden=128 \
        --steps 200 --batch-size 64 --run-dir runs/custom

A task gives the trainer four things — a model, a map-style dataset, an optimizer and a
loss — and the trainer does the rest: DDP, data order and sharding, checkpoints, resume.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train import ConfigError, TaskContext


class RegressionTask:
    """Fit a noisy linear map with a small MLP (data made from a fixed seed, no download)."""

    def __init__(self, hidden: int, samples: int) -> None:
        self.hidden = hidden
        self.samples = samples

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(16, self.hidden), nn.GELU(), nn.Dropout(0.1),
                             nn.Linear(self.hidden, 4))

    def build_dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(self.samples, 16, generator=g)
        y = x @ torch.randn(16, 4, generator=g) + 0.05 * torch.randn(self.samples, 4, generator=g)
        return TensorDataset(x, y)

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr)

    def loss(self, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def make_task(ctx: TaskContext) -> RegressionTask:
    """The factory ``--task`` names; it validates its own options."""
    known = {"hidden", "samples"}
    unknown = set(ctx.options) - known
    if unknown:
        raise ConfigError(f"unknown task option {sorted(unknown)[0]!r}: known: "
                          f"{', '.join(sorted(known))}")
    try:
        hidden = int(ctx.options.get("hidden", 64))
        samples = int(ctx.options.get("samples", 4096))
    except ValueError as exc:
        raise ConfigError(f"task option is not an integer ({exc})") from None
    return RegressionTask(hidden, samples)
