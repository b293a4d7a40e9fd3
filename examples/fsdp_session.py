"""A hand-written loop over a sharded model (FSDP2 or HSDP) made fault-tolerant with
ElasticSession: ``session.wrap(model, parallelism="fsdp")`` in place of ``fully_shard`` per
layer, the optimizer built after it, then the same five calls as the DDP tutorial.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/fsdp_session.py runs/fsdp
    torchrun --nproc-per-node 4 --max-restarts 3 examples/fsdp_session.py runs/hsdp hsdp 2
    elastic-train run --nproc-per-node 2 examples/fsdp_session.py runs/fsdp

Each rank writes its own shards of every checkpoint (no rank gathers the model); a restart
resumes from the newest sharded checkpoint at whatever world size the job has then,
resharded, mid-epoch, each sample once; at the same world size the result is bitwise the
one of a run that never failed. Under ``elastic-train run`` a lost worker is recovered in
place instead: the survivors keep their processes and this loop its ``model`` and
``optimizer`` (sharded again on the new mesh), the lost shards from the replica group
(hsdp) or the newest checkpoint (fsdp). ``close(export=...)`` writes the whole model's weights,
gathered from the final checkpoint's shards.
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train import ElasticSession

EPOCHS = 3


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 8, generator=g))
    return TensorDataset(x, y)


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    """Layers in an nn.ModuleList: session.wrap shards each, then the rest."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main(run_dir: str = "runs/fsdp-session", parallelism: str = "fsdp",
         replica_group_size: int = 0) -> None:
    session = ElasticSession(run_dir, checkpoint_every=10)
    torch.manual_seed(0)
    model = session.wrap(Model(), parallelism=parallelism,
                         replica_group_size=replica_group_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after wrap: its parameters
    loader = session.dataloader(make_dataset(), batch_size=64)
    session.restore(model=model, optimizer=optimizer)
    for epoch in session.epochs(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if session.step(loss):
                break
        if session.rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    session.close(export=f"{run_dir}/final.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(int, sys.argv[3:4]))
