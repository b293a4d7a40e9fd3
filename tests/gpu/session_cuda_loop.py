"""A hand-written DDP loop on the GPU made elastic with ``ElasticSession`` (tests/gpu).

    torchrun --nproc-per-node 1 tests/gpu/session_cuda_loop.py RUN_DIR [BACKEND]

The model, its DDP wrapper and every batch live on ``session.device``; the restore puts
the optimizer's state there too (checked at every step). Deterministic kernels, dropout
from the session's per-step seed: a resumed run ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from elastic_train import ElasticSession

TOTAL_STEPS = 200


def main() -> None:
    run_dir = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "auto"
    session = ElasticSession(run_dir, checkpoint_every=25, backend=backend, deterministic=True)
    device = session.device
    assert device.type == "cuda" or not torch.cuda.is_available(), f"picked {device}, not the GPU"
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 64, generator=g)
    dataset = TensorDataset(x, x @ torch.randn(64, 8, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(256, 8)).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    loader = session.dataloader(dataset, batch_size=64)
    session.restore(model=model, optimizer=optimizer)
    for _step, (inputs, targets) in session.steps(TOTAL_STEPS, loader):
        for state in optimizer.state.values():
            assert state["exp_avg"].device == device, "optimizer state not on the GPU"
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp_model(inputs), targets)
        loss.backward()
        optimizer.step()
        if session.step(loss):
            break
    session.close()


if __name__ == "__main__":
    main()
