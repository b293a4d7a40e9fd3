"""A hand-written loop under ``ElasticSession(on_save_failure="stop")`` whose disk fills up.

    torchrun --nproc-per-node 2 tests/integration/session_disk_full.py RUN_DIR [--fill]

With ``--fill``, rank 0 of the first incarnation lowers its own file-size limit
(RLIMIT_FSIZE) below one checkpoint once checkpoint FULL_AFTER is durable, so the write of
checkpoint FULL_AFTER + EVERY fails in the OS (EFBIG). To make the step the job stops at
certain, rank 0 then waits for that write's outcome (a test hook, not what a loop does), so
every rank must stop at the next step, FULL_AFTER + EVERY + 1.
"""

import resource
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_train import ElasticSession

STEPS, EVERY, FULL_AFTER = 40, 5, 10
FULL = 256 * 1024  # bytes: below one checkpoint of this model (~2 MB), above the event log


def main() -> None:
    run_dir, fill = sys.argv[1], "--fill" in sys.argv[2:]
    session = ElasticSession(run_dir, checkpoint_every=EVERY, keep_checkpoints=20,
                             on_save_failure="stop")
    fill = fill and session.rank == 0 and session.env.restart_count == 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    ddp_model = DDP(model)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    session.restore(model=model, optimizer=optimizer)
    for step in session.steps(STEPS):
        x = torch.randn(8, 256)
        loss = nn.functional.mse_loss(ddp_model(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if session.step(loss):
            break
        if fill and step + 1 == FULL_AFTER:
            session.checkpoints.finish()  # checkpoint FULL_AFTER is on disk
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL, hard))
        if fill and step + 1 == FULL_AFTER + EVERY:
            session.checkpoints.finish()  # its write failed: rank 0 votes to stop next step
    session.close()


if __name__ == "__main__":
    main()
