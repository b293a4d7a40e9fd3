"""The baseline: fault tolerance the way users hand-write it today.

Written like the PyTorch DDP tutorial and the torchelastic example: plain DDP, rank 0
``torch.save``s {model, optimizer, step} synchronously every N steps to one file; on a
restart every rank passes a barrier and ``torch.load``s it with ``map_location``; data
comes from a DistributedSampler with ``set_epoch``. Same model and data as elastic_train's
built-in task (the GPT of elastic_train.tasks.gpt on the same corpus windows) and the same
training recipe as the benchmark runs it (gradient clipping at 1.0, a cosine learning rate
without warmup), so that the comparison measures fault tolerance, not a recipe.

Only addition: timing marks appended to ``RUN_DIR/baseline.jsonl`` (rank 0), so that the
benchmark can compare it with elastic_train. Run it under torchrun:

    torchrun --nproc-per-node 2 benchmarks/baseline_ddp.py RUN_DIR --preset small --steps 100
"""

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.gpt import make_task
from elastic_train.worker.timeline import process_start_time

IMPORTED = time.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="0: never")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    os.makedirs(args.run_dir, exist_ok=True)
    path = os.path.join(args.run_dir, "checkpoint.pt")
    log = open(os.path.join(args.run_dir, "baseline.jsonl"), "a", buffering=1)

    def mark(event: str, **fields: object) -> None:
        if dist.get_rank() == 0:
            log.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")

    dist.init_process_group("gloo")
    group_ready = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    task = make_task(TaskContext({"preset": args.preset}))
    torch.manual_seed(0)
    model = task.build_model()
    ddp = DDP(model)
    ddp_ready = time.time()
    optimizer = task.build_optimizer(model, args.lr)
    dataset = task.build_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                        collate_fn=task.collate, drop_last=True)
    step = 0
    if os.path.exists(path):
        dist.barrier()
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    loaded = time.time()
    epoch = step // len(loader)
    first = True
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            for group in optimizer.param_groups:  # cosine to a tenth, as elastic_train's
                group["lr"] = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step /
                                                                   args.steps)))
            loss = task.loss(ddp, batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if first:
                mark("startup", process_start=process_start_time(), imported=IMPORTED,
                     group_ready=group_ready, ddp_ready=ddp_ready, restored=loaded,
                     first_step_done=time.time(), resumed_step=step - 1,
                     restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                     world_size=world)
                first = False
            mark("step", step=step, loss=loss.item(), world_size=world)
            if args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
                began = time.time()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, path)
                mark("checkpoint_saved", step=step, stall_seconds=time.time() - began)
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
