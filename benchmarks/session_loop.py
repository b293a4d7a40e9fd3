"""The hand-written loop that benchmarks/session_recovery.py kills (not a test fixture).

    session_loop.py RUN_DIR STEPS live|restart

An ElasticSession loop over an MLP of about 4.2 M parameters (SGD with momentum: 34 MB of
state), a batch of 64 per rank, a checkpoint every 20 steps. ``restart`` sets
``ElasticSession(..., recovery="restart")``: every failure restarts the workers from the
newest checkpoint, as under plain torchrun.
"""

import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train import ElasticSession

RUN_DIR, STEPS, RECOVERY = sys.argv[1], int(sys.argv[2]), sys.argv[3]
WIDTH = 1024


def main() -> None:
    session = ElasticSession(RUN_DIR, checkpoint_every=20, recovery=RECOVERY)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                          nn.ReLU(), nn.Linear(WIDTH, 256))
    ddp = session.wrap(model)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8192, 256, generator=g), torch.randn(8192, 256, generator=g))
    loader = session.dataloader(data, batch_size=64)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    session.restore(model=model, optimizer=optimizer)
    for _, (x, y) in session.steps(STEPS, loader):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        if session.step(loss):
            break
    session.close()


if __name__ == "__main__":
    main()
