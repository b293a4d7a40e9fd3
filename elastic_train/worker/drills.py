"""The drills a worker runs on itself, for tests and users' rehearsals (issue 41):
``--inject-bitflip`` (integrity/drill.py: one bit of a weight or an optimizer state flipped
after a chosen step) and ``--inject-slowdown`` (integrity/slowdown.py: the rank's process run
at 1/FACTOR of its speed from a chosen step). Each says what it did in one line."""

from __future__ import annotations

import subprocess
import sys
from typing import TextIO

import torch

from elastic_train.integrity.drill import BitflipDrill
from elastic_train.integrity.slowdown import SlowdownDrill

__all__ = ["Drills"]


class Drills:
    """The drills of one worker, from their options' texts (empty: none)."""

    def __init__(self, bitflip: str, slowdown: str, out: TextIO | None = None) -> None:
        self._bitflip = BitflipDrill.parse(bitflip)
        self._slowdown = SlowdownDrill.parse(slowdown)
        self._slowing: subprocess.Popen[bytes] | None = None
        self._out = out or sys.stderr

    def after_step(self, rank: int, step: int, first_incarnation: bool,
                   model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Run what is due after optimizer step ``step`` on ``rank``."""
        if self._bitflip is not None and self._bitflip.due(rank, step, first_incarnation):
            flipped = self._bitflip.apply(model, optimizer)
            self._say(f"drill: rank {rank} flipped {flipped} after step {step} "
                      "(--inject-bitflip)")
        slow = self._slowdown
        if slow is not None and self._slowing is None and slow.due(rank, step):
            self._slowing = slow.start()
            self._say(f"drill: rank {rank} runs at 1/{slow.factor:g} of its speed from step "
                      f"{step} on (--inject-slowdown: SIGSTOP/SIGCONT, pid "
                      f"{self._slowing.pid})")

    def close(self) -> None:
        """End the slowdown (the helper continues this process as it goes)."""
        if self._slowing is not None:
            self._slowing.terminate()
            try:
                self._slowing.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._slowing.kill()
            self._slowing = None

    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)
