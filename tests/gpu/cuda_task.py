"""The built-in GPT task on CUDA, with checks and one injected hang, for tests/gpu.

Options (``--task-opt``), besides the GPT task's own:

- ``require_cuda=1``: every ``loss`` checks that the parameters and the optimizer's state
  live on the GPU (a restore that left them on the CPU fails the step, naming the tensor);
- ``hang_rank=R`` and ``hang_after=N``: rank R's Nth forward pass runs a CUDA kernel that
  spins for about an hour, once per run (a flag file in the run directory), as a wedged
  kernel or a collective that never completes would.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.gpt import GPTTask
from elastic_train.tasks.gpt import make_task as make_gpt_task

HANG_FLAG = "hung-once"
_SPIN_CYCLES = 2 * 10**9 * 3600  # about an hour at 2 GHz


class CudaCheckedTask:
    """Delegates to the GPT task; checks devices and injects the hang."""

    def __init__(self, inner: GPTTask, run_dir: Path, require_cuda: bool,
                 hang_rank: int | None, hang_after: int) -> None:
        self.inner = inner
        self.run_dir = run_dir
        self.require_cuda = require_cuda
        self.hang_rank = hang_rank
        self.hang_after = hang_after
        self.calls = 0
        self.optimizer: torch.optim.Optimizer | None = None

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def build_dataset(self) -> Any:
        return self.inner.build_dataset()

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        self.optimizer = self.inner.build_optimizer(model, lr)
        return self.optimizer

    def collate(self, samples: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner.collate(samples)

    def _check_devices(self, model: nn.Module, batch: torch.Tensor) -> None:
        tensors = [(f"parameter {name}", p) for name, p in model.named_parameters()]
        tensors.append(("batch", batch))
        if self.optimizer is not None:
            for i, state in enumerate(self.optimizer.state.values()):
                tensors += [(f"optimizer state {i}.{k}", v) for k, v in state.items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0]
        for what, tensor in tensors:
            if tensor.device.type != "cuda":
                raise AssertionError(f"{what} is on {tensor.device}, not on the GPU")

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.require_cuda:
            self._check_devices(model, batch)
        rank = int(os.environ.get("RANK", "0"))
        flag = self.run_dir / HANG_FLAG
        if rank == self.hang_rank and self.calls == self.hang_after and not flag.exists():
            flag.write_text(f"rank {rank} pid {os.getpid()}\n")
            if torch.cuda.is_available():
                torch.cuda._sleep(_SPIN_CYCLES)  # on the compute stream: all after it waits
            else:  # the dry run on a CPU (test_gpu.py): an operation that never returns
                threading.Event().wait()
        return self.inner.loss(model, batch)


def make_task(ctx: TaskContext) -> CudaCheckedTask:
    options = dict(ctx.options)
    require_cuda = options.pop("require_cuda", "0") in ("1", 1, True, "true")
    hang_rank = options.pop("hang_rank", None)
    hang_after = int(options.pop("hang_after", 0))
    return CudaCheckedTask(make_gpt_task(TaskContext(options, ctx.seed, ctx.run_dir)),
                           Path(ctx.run_dir), require_cuda,
                           None if hang_rank is None else int(hang_rank), hang_after)
