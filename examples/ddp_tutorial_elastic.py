"""AFTER: the same loop made fault-tolerant with elastic_train (seven lines changed, and a
stop on SIGTERM).

    torchrun --nproc-per-node 2 --max-restarts 3 examples/ddp_tutorial_elastic.py
    elastic-train run --nproc-per-node 2 examples/ddp_tutorial_elastic.py   # live recovery

Checkpoints are atomic and checksummed, written every 20 steps; a restart resumes from the
newest valid one mid-epoch, with no sample repeated or skipped and dropout randomness
derived from (seed, step, rank): the result is bitwise the one of a run that never failed.
SIGTERM (a preemption) checkpoints the step every rank is at and ends the loop; the same
command resumes from there.
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train import ElasticSession

RUN_DIR = sys.argv[1] if len(sys.argv) > 1 else "runs/tutorial-elastic"
EPOCHS = 4


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 10, generator=g)
    y = x @ torch.randn(10, 5, generator=g) + 0.1 * torch.randn(2048, 5, generator=g)
    return TensorDataset(x, y)


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    session = ElasticSession(RUN_DIR, checkpoint_every=20)          # 1: was init_process_group
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = session.wrap(model)                                 # 2: was DDP(model)
    dataset = make_dataset()
    loader = session.dataloader(dataset, batch_size=32)             # 3: was DistributedSampler
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    session.restore(model=model, optimizer=optimizer)               # 4: was barrier + torch.load
    for epoch in session.epochs(EPOCHS):                            # 5: was range + set_epoch
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            if session.step(loss):                                  # 6: counts, checkpoints;
                break                                               # True: SIGTERM, stop now
        if session.rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}")
    session.close()                                                 # 7: was rank-0 torch.save


if __name__ == "__main__":
    main()
