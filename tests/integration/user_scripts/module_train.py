"""A user's training module, run as ``python -m`` (torchrun ``-m``): a loop of its own with
an explicit gradient all-reduce (no DDP), a barrier, ``destroy_process_group()``. Nothing of
elastic_train. ``--steps N --pace S --exit-code C``."""

import argparse
import sys
import time

import torch
import torch.distributed as dist


def train(steps: int, pace: float) -> float:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    for step in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        if step % 10 == 0:
            print(f"rank {dist.get_rank()} step {step}", flush=True)
        if pace:
            time.sleep(pace)
    return loss.item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    loss = train(args.steps, args.pace)
    dist.barrier()
    print(f"module rank {dist.get_rank()}: {__name__} loss {loss:.4f}", flush=True)
    dist.destroy_process_group()
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
