"""A hand-written loop on ElasticSession for the live-recovery tests (test_session_live.py).

    elastic-train run [options] session_live_loop.py RUN_DIR STEPS PACE_SECONDS [plain-ddp]
        [step-timeout=SECONDS]

A step loop over the session's DataLoader (a global batch of 16, the same at any world
size) with an LR scheduler. Each rank records the sample indices of every step it starts,
before its gradients are reduced, with the generation of the world it trains in: a step
redone in a newer generation is recorded again, and the newest generation's records are
the ones that made the weights. ``plain-ddp`` wraps the model in DDP itself instead of
``session.wrap``: live recovery is then impossible, and the job takes the restart path.
``step-timeout=SECONDS`` gives the session a step watchdog.
"""

import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from elastic_train import ElasticSession

RUN_DIR, STEPS, PACE = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
PLAIN_DDP = "plain-ddp" in sys.argv[4:]
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


def main() -> None:
    session = ElasticSession(RUN_DIR, checkpoint_every=10, keep_checkpoints=100,
                             step_timeout=STEP_TIMEOUT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model) if PLAIN_DDP else session.wrap(model)
    loader = session.dataloader(Indexed(), global_batch_size=GLOBAL_BATCH)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s / 50))
    session.restore(model=model, optimizer=optimizer, scheduler=scheduler)
    records = open(os.path.join(RUN_DIR, f"samples-{os.getpid()}.jsonl"), "a", buffering=1)
    for step, (x, y, index) in session.steps(STEPS, loader):
        live = session.runtime.live
        records.write(json.dumps({
            "step": step + 1, "rank": session.rank, "world_size": session.world_size,
            "generation": live.generation if live is not None else 0, "pid": os.getpid(),
            "indices": index.tolist()}) + "\n")
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        time.sleep(PACE)
        if session.step(loss):
            break
    records.close()
    session.close()


if __name__ == "__main__":
    main()
