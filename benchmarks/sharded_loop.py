"""One hand-written FSDP2 loop of the built-in GPT task, checkpointed either by
ElasticSession (``ours``: sharded checkpoints, background writes) or the way torchtitan and
DCP's tutorial do it (``dcp``: ``dcp.async_save`` of ``get_state_dict`` every N steps, the
previous save's future waited for before the next). Run by benchmarks/sharded.py under
torchrun; every rank appends ``{"step", "time"}`` lines to ``RUN_DIR/steps-RANK.jsonl``.
``live`` and ``restart`` are ``ours`` with that ``recovery`` of the session, for a run under
``elastic-train run`` whose worker is killed (sharded.py's section 5); ``ours`` restarts.

    torchrun --nproc-per-node 2 benchmarks/sharded_loop.py ours RUN_DIR medium 24 4 8
    elastic-train run --nproc-per-node 2 benchmarks/sharded_loop.py live RUN_DIR medium 99 4 8
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train import ElasticSession
from elastic_train.tasks.base import TaskContext, collate
from elastic_train.tasks.gpt import make_task
from elastic_train.worker.sampler import epoch_order


def main(mode: str, run_dir: str, preset: str, steps: int, every: int, batch: int) -> None:
    task = make_task(TaskContext({"preset": preset}))
    dataset = task.build_dataset()
    order = epoch_order(len(dataset), 0, 0)
    session = None
    if mode in ("ours", "live", "restart"):
        session = ElasticSession(run_dir, checkpoint_every=every, keep_checkpoints=2,
                                 recovery="live" if mode == "live" else "restart")
        rank, world = session.rank, session.world_size
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = task.build_model()
    if session is not None:
        model = session.wrap(model, parallelism="fsdp")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = task.build_optimizer(model, 1e-3)
    # async_save's thread plans with collectives: on the training group they would
    # interleave with FSDP's (a gloo size mismatch, seen); torchtitan gives it a group.
    save_group = dist.new_group(backend="gloo") if session is None else None
    if session is not None:
        session.restore(model=model, optimizer=optimizer)
    out = open(Path(run_dir) / f"steps-{rank}.jsonl", "a", buffering=1)
    pending = None
    # the session's own step loop: a resumed or recovered run goes on at the step to train
    numbers = (n + 1 for n in session.steps(steps)) if session is not None \
        else iter(range(1, steps + 1))
    for step in numbers:
        start = ((step - 1) * batch) % (len(order) - batch)
        mine = order[start + rank * batch // world:start + (rank + 1) * batch // world]
        loss = task.loss(model, collate(task, [dataset[int(i)] for i in mine]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if session is not None:
            session.step(loss)
        elif step % every == 0 and step < steps:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if pending is not None:
                pending.result()  # one save in flight at a time, as torchtitan does
            model_state, optim_state = get_state_dict(model, optimizer)
            pending = dcp.async_save({"model": model_state, "optimizer": optim_state},
                                     checkpoint_id=os.path.join(run_dir, f"dcp-{step}"),
                                     process_group=save_group)
        out.write(json.dumps({"step": step, "time": time.time()}) + "\n")
    if pending is not None:
        pending.result()
    if session is not None:
        session.close()
    else:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    mode, run_dir, preset, steps, every, batch = sys.argv[1:7]
    main(mode, run_dir, preset, int(steps), int(every), int(batch))
