"""Under torchrun (gloo, CPU): a small model sharded by FSDP2 over the world, and a sharded
save's parts as the agents' memory tier holds them (checkpoint/sharded.py).

``save DIR``: two Adam steps, then each rank's part (``sharded_save.encode(...).payloads()``)
into ``DIR/part-R.bin`` (rank 0 also the common state, part W), and rank 0 the whole
parameters and Adam moments into ``DIR/whole.pt``. ``load DIR``: the model built from
another seed at this world size, filled from those parts by
``sharded_restore.restore_from_parts``; each rank writes
``DIR/load-W-R.json``: how many parts it read, and whether every whole tensor is the
saved one, bit for bit.

It ends as our own workers end (``process_exit.exit_command``: atexit handlers, streams
flushed, then ``os._exit``), not through the interpreter's teardown: gloo's thread frees the
barrier's work, and with it the full tensors of the all-gathers before it, a moment after
the barrier's waiter woke; if the interpreter is finalizing by then, that thread cannot take
the GIL to drop their Python objects and the process aborts ("terminate called without an
active exception", SIGABRT; 2 of 8 runs of ``save`` here, the core showed
~AsyncBarrierWork -> ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.checkpoint import sharded, sharded_restore, sharded_save
from elastic_train.checkpoint.snapshot import SnapshotBuffers
from elastic_train.process_exit import exit_command
from elastic_train.worker.distributed import Group
from elastic_train.worker.sharding import shard_model

ROWS = 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(ROWS, ROWS) for _ in range(3))
        self.head = nn.Linear(ROWS, ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def whole(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, gathered whole (a collective: every rank calls it)."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = optimizer.state[param][key].full_tensor()
    return out


def main(phase: str, folder: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group(rank, world, "gloo", torch.device("cpu"))
    torch.manual_seed(0 if phase == "save" else 1)
    model = shard_model(Model(), group, "fsdp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    counter = Counter()
    objects = {"model": model, "optimizer": optimizer, "trainer": counter}
    if phase == "save":
        for step in range(2):
            x = torch.randn(4, ROWS, generator=torch.Generator().manual_seed(rank * 10 + step))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            counter.step += 1
        shot = sharded.snapshot(objects, rank, world, SnapshotBuffers())
        for part, data in sharded_save.encode(shot).payloads().items():
            (folder / f"part-{part}.bin").write_bytes(data)
        saved = whole(model, optimizer)
        if rank == 0:
            torch.save(saved, folder / "whole.pt")
    else:
        x = torch.randn(4, ROWS)  # one step first: Adam's moments exist to be filled
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        parts = len(list(folder.glob("part-*.bin")))
        read = sharded_restore.restore_from_parts(
            lambda part: (folder / f"part-{part}.bin").read_bytes(), parts, objects, "cpu",
            "the parts")
        expected = torch.load(folder / "whole.pt", weights_only=True)
        now = whole(model, optimizer)
        equal = sorted(now) == sorted(expected) and all(
            torch.equal(now[k], expected[k]) for k in expected)
        (folder / f"load-{world}-{rank}.json").write_text(json.dumps(
            {"read": read, "equal": equal, "step": counter.step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    exit_command(0)
