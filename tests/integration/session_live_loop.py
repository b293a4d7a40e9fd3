"""A hand-written loop on ElasticSession for the live-recovery tests (test_session_live.py).

    elastic-train run [options] session_live_loop.py RUN_DIR STEPS PACE_SECONDS [plain-ddp]
        [fsdp] [step-timeout=SECONDS] [crash-at=STEP:RANK]

A step loop over the session's DataLoader (a global batch of 16, the same at any world
size) with an LR scheduler and an EMA of the weights, updated after ``optimizer.step()``
unless the step failed (``session.step_failed``); rank 0 writes the final EMA's digest
to RUN_DIR/ema.sha256. Each rank records the sample indices of every step it starts,
before its gradients are reduced, with the generation of the world it trains in: a step
redone in a newer generation is recorded again, and the newest generation's records are
the ones that made the weights. ``plain-ddp`` wraps the model in DDP itself instead of
``session.wrap``: live recovery is then impossible, and the job takes the restart path.
``fsdp`` wraps it with ``session.wrap(model, parallelism="fsdp")`` instead (no EMA then: an
EMA of sharded weights is one more object the loop would have to move to each new mesh).
``step-timeout=SECONDS`` gives the session a step watchdog. ``crash-at=STEP:RANK``: that
rank SIGKILLs itself in that step after its forward, before its backward (once: a marker
file in RUN_DIR says it did), so that the others fail inside the gradient all-reduce.
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elastic_train import ElasticSession

RUN_DIR, STEPS, PACE = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
PLAIN_DDP = "plain-ddp" in sys.argv[4:]
SHARDED = "fsdp" in sys.argv[4:]
CRASH_AT = next((tuple(map(int, a.split("=", 1)[1].split(":"))) for a in sys.argv[4:]
                 if a.startswith("crash-at=")), None)
STEP_TIMEOUT = next((float(a.split("=", 1)[1]) for a in sys.argv[4:]
                     if a.startswith("step-timeout=")), None)
SAMPLES = 256
GLOBAL_BATCH = 16


class Indexed(Dataset):
    """Fixed random regression data; each item carries its index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class EMA:
    """An exponential moving average of a model's weights (what a loop updates by itself
    after optimizer.step())."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        for s, t in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(t)

    def digest(self) -> str:
        return hashlib.sha256(b"".join(s.numpy().tobytes() for s in self.shadow)).hexdigest()


def main() -> None:
    session = ElasticSession(RUN_DIR, checkpoint_every=10, keep_checkpoints=100,
                             step_timeout=STEP_TIMEOUT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    if SHARDED:
        ddp = session.wrap(model, parallelism="fsdp")
    else:
        ddp = DistributedDataParallel(model) if PLAIN_DDP else session.wrap(model)
    loader = session.dataloader(Indexed(), global_batch_size=GLOBAL_BATCH)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s / 50))
    ema = None if SHARDED else EMA(model)
    session.restore(model=model, optimizer=optimizer, scheduler=scheduler,
                    **({} if ema is None else {"ema": ema}))
    records = open(os.path.join(RUN_DIR, f"samples-{os.getpid()}.jsonl"), "a", buffering=1)
    for step, (x, y, index) in session.steps(STEPS, loader):
        live = session.runtime.live
        records.write(json.dumps({
            "step": step + 1, "rank": session.rank, "world_size": session.world_size,
            "generation": live.generation if live is not None else 0, "pid": os.getpid(),
            "indices": index.tolist()}) + "\n")
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        if (step + 1, session.rank) == CRASH_AT:
            marker = os.path.join(RUN_DIR, f"crashed-at-{step + 1}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if ema is not None and not session.step_failed:  # a failed step is redone:
            ema.update(model)                              # update once, when it counts
        time.sleep(PACE)
        if session.step(loss):
            break
    records.close()
    if ema is not None and session.rank == 0 and session.stopped_at is None:
        with open(os.path.join(RUN_DIR, "ema.sha256"), "w") as f:
            f.write(ema.digest())
    session.close()


if __name__ == "__main__":
    main()
