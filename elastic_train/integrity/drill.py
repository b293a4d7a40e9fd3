"""``--inject-bitflip RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]``: the drill of silent data
corruption. After optimizer step STEP, rank RANK flips bit BIT (default 12, a mantissa bit of
a float32: a relative change of about 1e-4, as a faulty GPU or memory makes it, and training
goes on) of element INDEX (default 0) of its first parameter (``weight``, the default) or of
that parameter's first optimizer state (``optimizer``: Adam's ``exp_avg``), in place, once
per job (in its first incarnation). ``--verify-every`` then names the rank (tests, users'
drills: docs/wrong-or-slow-nodes.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_train.integrity.bitflip import flip_bit

__all__ = ["BitflipDrill"]

TARGETS = ("weight", "optimizer")


@dataclass(frozen=True)
class BitflipDrill:
    """One planned bit flip (config.py checks the text's shape)."""

    rank: int
    step: int
    target: str = "weight"
    index: int = 0
    bit: int = 12

    @classmethod
    def parse(cls, text: str) -> BitflipDrill | None:
        """The drill ``text`` describes (None for an empty text)."""
        if not text:
            return None
        parts = text.split(":")
        rank, step = int(parts[0]), int(parts[1])
        target = parts[2] if len(parts) > 2 else "weight"
        if target not in TARGETS:
            raise ValueError(f"--inject-bitflip target {target!r}: use weight or optimizer")
        index = int(parts[3]) if len(parts) > 3 else 0
        bit = int(parts[4]) if len(parts) > 4 else 12
        return cls(rank, step, target, index, bit)

    def due(self, rank: int, step: int, first_incarnation: bool) -> bool:
        return first_incarnation and rank == self.rank and step == self.step

    def apply(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
        """Flip the bit; what was flipped, for the drill's line."""
        name, param = next(iter(model.named_parameters()))
        tensor = param.data
        if self.target == "optimizer":
            state = optimizer.state.get(param, {})
            found = [(k, v) for k, v in state.items()  # a moment, not Adam's step count
                     if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() > self.index]
            if not found:
                raise ValueError(f"--inject-bitflip: the optimizer holds no state of {name} "
                                 "yet (flip it after its first step)")
            key, tensor = found[0]
            name = f"{name} ({key})"
        flip_bit(tensor, self.index, self.bit)
        return f"bit {self.bit} of element {self.index} of {name}"
