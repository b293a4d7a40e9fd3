"""Two parts of the built-in trainer's step, from its options: the learning rate's schedule
(``--warmup-steps``, ``--lr-schedule``) and a rank's share of the global batch split into
forward passes (``--micro-batch-size``)."""

from __future__ import annotations

import math

import torch

__all__ = ["lr_factor", "micro_batches", "rounded"]


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): warm-up, then decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def micro_batches(indices: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """Split a rank's share into forward passes of at most ``limit`` samples (0: one pass)."""
    if limit <= 0 or len(indices) <= limit:
        return [indices]
    return list(torch.split(indices, limit))


def rounded(value: float | None, digits: int = 6) -> float | None:
    """``value`` rounded for an event (None stays None)."""
    return None if value is None else round(value, digits)
