"""The process group: backend choice, reliable init under torchrun, and the few collectives.

These are the package's only collectives. Every one takes the group's timeout, and callers
reach them on every rank in the same order (the per-step vote, restore, save coordination,
shutdown).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.env import WorkerEnv
from elastic_train.errors import DistributedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """The initialised process group of this worker."""

    rank: int
    world_size: int
    backend: str
    device: torch.device


def pick_device(env: WorkerEnv) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is there, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device) -> str:
    """``auto`` means nccl on CUDA and gloo on the CPU."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistributedError("--backend nccl needs CUDA devices and none is visible: use "
                               "--backend gloo (or auto)")
    return requested


def _store_for(env: WorkerEnv, timeout: timedelta) -> dist.Store | None:
    """The store the group is formed on; None means torch's env:// default.

    When torchrun shares its agent's TCPStore with the workers (the 2.x default), the keys
    of a dead incarnation stay in it and can send the next incarnation's gloo connections
    to dead addresses (FIELD-NOTES: 7 of 26 restarts hung). Under one agent all ranks
    share a restart count, so a per-restart key prefix gives each incarnation clean keys.
    Across several agents restart counts differ; there a store made fresh for every round
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``elastic-train run`` and the k8s
    manifests set) is the fix, and we warn when it is missing.
    """
    if not env.under_torchrun:
        return dist.HashStore() if env.world_size == 1 else None
    if not env.use_agent_store:
        return None
    if env.master_port is None:
        raise DistributedError("MASTER_PORT is not set although torchrun says it shares its "
                               "store: run the worker under torchrun or elastic-train run")
    store = dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                          is_master=False, timeout=timeout, wait_for_workers=False)
    if env.single_node:
        return dist.PrefixStore(f"elastic_train/{env.run_id}/restart-{env.restart_count}", store)
    if env.rank == 0:
        log.warning("workers of several agents share the agent's TCPStore; restarts are more "
                    "reliable with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for torchrun")
    return store


def init_group(env: WorkerEnv, backend: str, timeout_seconds: float) -> Group:
    """Form the process group of this incarnation (idempotent within a process)."""
    device = pick_device(env)
    chosen = pick_backend(backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size(), chosen, device)
    timeout = timedelta(seconds=timeout_seconds)
    store = _store_for(env, timeout)
    try:
        if store is None:
            dist.init_process_group(chosen, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        else:
            dist.init_process_group(chosen, store=store, rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"rank {env.rank} could not join the process group at {env.master_addr}:"
            f"{env.master_port} ({str(exc).splitlines()[0]}): check that every worker reaches "
            "that address, or raise --collective-timeout") from exc
    return Group(env.rank, env.world_size, chosen, device)


def barrier(group: Group) -> None:
    """Wait for every rank (bounded by the group's timeout)."""
    if group.world_size > 1:
        dist.barrier(device_ids=[group.device.index] if group.device.type == "cuda" else None)


def broadcast_json(group: Group, value: Any, src: int = 0) -> Any:
    """Send a JSON-able value from ``src`` to every rank (no pickle on the wire)."""
    if group.world_size == 1:
        return value
    if group.rank == src:
        data = json.dumps(value).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=group.device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=group.device)
    dist.broadcast(size, src)
    if group.rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    dist.broadcast(buffer, src)
    return json.loads(bytes(buffer.cpu().tolist()).decode())


def sum_over_ranks(group: Group, values: torch.Tensor) -> list[float]:
    """Sum a small tensor of this rank's values over every rank (in place); its items.

    The per-step vote (runtime.py) uses it: the loss and every stop flag travel in one
    all-reduce, so that every rank leaves the loop at the same step.
    """
    if group.world_size > 1:
        dist.all_reduce(values)
    return values.tolist()


def all_true(group: Group, flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank (a barrier that carries a vote)."""
    if group.world_size == 1:
        return flag
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group.device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return bool(vote.item())


def default_store() -> dist.Store | None:
    """The store the process group was formed on (for heartbeats), if torch exposes it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def destroy_group() -> None:
    """Tear the group down (after every rank finished its last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
