"""BEFORE: a hand-written DDP loop the way the PyTorch DDP tutorial and torchelastic do it.

    torchrun --nproc-per-node 2 examples/ddp_tutorial.py

Rank 0 saves every epoch; after a restart every rank loads that file and the epoch starts
again at batch 0 (samples repeated), dropout randomness is not restored, and a crash
during torch.save leaves a torn file that the next start cannot read.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CHECKPOINT = "runs/tutorial-before.pt"
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
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    start_epoch = 0
    if os.path.exists(CHECKPOINT):
        dist.barrier()
        state = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            os.makedirs(os.path.dirname(CHECKPOINT), exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, CHECKPOINT)
            print(f"epoch {epoch} loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
