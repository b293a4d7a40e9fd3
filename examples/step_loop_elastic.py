"""A step loop (no epochs, a fresh random batch each step) made fault-tolerant, and the
final weights written where a tutorial's ``torch.save`` put them.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/step_loop_elastic.py runs/steps

``session.steps(TOTAL_STEPS)`` starts at the step the newest checkpoint holds (0 on a fresh
run), so a resumed run does not train TOTAL_STEPS more. The batches come from torch's
global generator, which the session seeds from (seed, step, rank) at every step: a resumed
run draws the batches the uninterrupted one drew, and ends with its weights, bit for bit.
"""

import sys

import torch
from torch import nn

from elastic_train import ElasticSession

RUN_DIR = sys.argv[1] if len(sys.argv) > 1 else "runs/steps"
TOTAL_STEPS = 300


def main() -> None:
    session = ElasticSession(RUN_DIR, checkpoint_every=50)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    ddp_model = session.wrap(model)                  # was: DDP(model)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    target = torch.randn(10, 1, generator=torch.Generator().manual_seed(1))
    session.restore(model=model, optimizer=optimizer)
    for step in session.steps(TOTAL_STEPS):         # was: for step in range(TOTAL_STEPS)
        x = torch.randn(32, 10)
        loss = nn.functional.mse_loss(ddp_model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if session.step(loss):                       # True after a SIGTERM: stop now
            break
        if step % 100 == 0 and session.rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
    session.close(export=f"{RUN_DIR}/model.safetensors")  # was: rank-0 torch.save(...)


if __name__ == "__main__":
    main()
