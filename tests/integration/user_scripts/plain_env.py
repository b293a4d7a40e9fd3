"""A user's script that knows torchrun only through LOCAL_RANK, RANK and WORLD_SIZE: DDP on
its own shard of the data, ``destroy_process_group()`` at the end, then ``sys.exit`` with
the code it was given. Nothing of elastic_train. ``STEPS PACE [EXIT_CODE]``."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    steps, pace = int(sys.argv[1]), float(sys.argv[2])
    code = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(64 * world, 16)[rank::world]
    for step in range(steps):
        loss = model(data).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"rank {rank} step {step}", flush=True)
        if pace:
            time.sleep(pace)
    print(f"rank {rank} (local {local_rank}) of {world}: loss {loss.item():.4f} after "
          f"{steps} steps", flush=True)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
