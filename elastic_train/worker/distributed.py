"""The process group: backend choice, reliable init under torchrun, and the few collectives.

These are the package's only collectives (beside DDP's gradient all-reduce, data_parallel.py). Every
one takes the group's timeout, and callers reach them on every rank in the same order (the
per-step vote, restore, save coordination, shutdown); every wait is abortable (aborts.py).
"""

from __future__ import annotations

import json
import logging
import socket
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.errors import DistributedError
from elastic_train.live import state_wire
from elastic_train.live.messages import store_prefix
from elastic_train.network import advertised_loopback
from elastic_train.worker import aborts, torch_seams
from elastic_train.worker.env import WorkerEnv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """The initialised process group of this worker (checkpoint/manager.py's ``Ranks``: the
    methods are this module's collectives, for code below the worker that may not import
    it)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    def all_true(self, flag: bool) -> bool:
        return all_true(self, flag)

    def broadcast_json(self, value: Any, src: int = 0) -> Any:
        return broadcast_json(self, value, src)

    def barrier(self) -> None:
        barrier(self)


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


def _store_address(env: WorkerEnv) -> str:
    """HOST:PORT of the store this worker's group forms on (for messages)."""
    return f"{env.master_addr}:{env.master_port}"


def agent_store(env: WorkerEnv, timeout: timedelta) -> dist.Store:
    """A client of the agent's store (torchrun shares it with its workers)."""
    if env.master_port is None:
        raise DistributedError("MASTER_PORT is not set although torchrun says it shares its "
                               "store: run the worker under torchrun or elastic-train run")
    return dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                         is_master=False, timeout=timeout, wait_for_workers=False)


def _store_for(env: WorkerEnv, timeout: timedelta) -> dist.Store | None:
    """The store the group is formed on; None means torch's env:// default.

    When torchrun shares its agent's TCPStore with the workers (the 2.x default), the keys
    of a dead incarnation stay in it and can send the next incarnation's gloo connections
    to dead addresses (docs/stock-torch.md: 7 of 26 restarts hung). Under one agent all ranks
    share a restart count, so a per-restart key prefix gives each incarnation clean keys.
    Across several agents restart counts differ; there a store made fresh for every round
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``elastic-train run`` and the k8s
    manifests set) is the fix, and we warn when it is missing.
    """
    if not env.under_torchrun:
        return dist.HashStore() if env.world_size == 1 else None
    if not env.use_agent_store:
        return None
    store = agent_store(env, timeout)
    if env.single_node:
        return dist.PrefixStore(store_prefix(env.run_id, env.restart_count), store)
    if env.rank == 0:
        log.warning("workers of several agents share the agent's TCPStore; restarts are more "
                    "reliable with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for torchrun")
    return store


def init_group(env: WorkerEnv, backend: str, timeout_seconds: float,
               generation: int = 0, connect_seconds: float | None = None,
               store: dist.Store | None = None, store_address: str | None = None) -> Group:
    """Form the process group of this incarnation (idempotent within a process);
    ``generation``: the world re-formed in place that this group belongs to, formed on
    ``store`` at ``store_address`` (worker/live_world.py; else the store torchrun gives);
    ``connect_seconds``: a shorter bound for forming it (a world re-formed in place, where
    a member lost meanwhile must not hold the others for the whole collective timeout)."""
    device = pick_device(env)
    chosen = pick_backend(backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size(), chosen, device)
    timeout = timedelta(seconds=timeout_seconds)
    connect = timedelta(seconds=min(connect_seconds or timeout_seconds, timeout_seconds))
    where = store_address or _store_address(env)
    if store is None:
        store = _store_for(env, connect)
    aborts.enter_generation(generation)
    try:
        if store is None:
            dist.init_process_group(chosen, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=connect)
        else:
            dist.init_process_group(chosen, store=store, rank=env.rank,
                                    world_size=env.world_size, timeout=connect)
        if connect != timeout:
            dist.group.WORLD.set_timeout(timeout)
    except (RuntimeError, ValueError) as exc:
        # The failed group still counted itself: the next one would take its store keys
        # under another index than a worker starting afresh, and never meet it.
        torch_seams.reset_group_count()
        raise DistributedError(_join_failure_line(env, where, str(exc))) from exc
    return Group(env.rank, env.world_size, chosen, device)


def _join_failure_line(env: WorkerEnv, where: str, error: str) -> str:
    """The line for a process group this worker could not join: whom it could not reach.
    A peer that advertised a loopback address (its host name resolves to loopback) is
    named as such, with the fix."""
    first = error.splitlines()[0] if error else "no detail"
    loopback = advertised_loopback(error)
    if loopback is not None:
        return (f"rank {env.rank} on {socket.gethostname()} could not connect to a peer "
                f"that advertised the loopback address {loopback} (its host name resolves to "
                f"loopback), forming the group at {where}: run the job with --local-addr "
                "set to each host's IP address, or set GLOO_SOCKET_IFNAME "
                f"(NCCL_SOCKET_IFNAME on GPUs) to the interface the nodes share ({first})")
    return (f"rank {env.rank} on {socket.gethostname()} could not join the process group at "
            f"{where} ({first}): check that every worker reaches that address and that "
            "each advertises one the others reach (GLOO_SOCKET_IFNAME), or raise "
            "--collective-timeout")


def barrier(group: Group) -> None:
    """Wait for every rank (bounded by the group's timeout)."""
    if group.world_size > 1:
        aborts.wait(dist.barrier(async_op=True,
                           device_ids=[group.device.index] if group.device.type == "cuda"
                           else None))


def broadcast_bytes(group: Group, data: bytes | None, src: int = 0) -> bytes:
    """Send bytes from ``src`` (``data`` there, None elsewhere) to every rank."""
    if group.world_size == 1:
        return data or b""
    if group.rank == src:
        assert data is not None
        size = torch.tensor([len(data)], dtype=torch.int64, device=group.device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=group.device)
    aborts.wait(dist.broadcast(size, src, async_op=True), size)
    if group.rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device)  # type: ignore[arg-type]
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    aborts.wait(dist.broadcast(buffer, src, async_op=True), buffer)
    return data if group.rank == src else buffer.cpu().numpy().tobytes()  # type: ignore[return-value]


def broadcast_json(group: Group, value: Any, src: int = 0) -> Any:
    """Send a JSON-able value from ``src`` to every rank (no pickle on the wire)."""
    if group.world_size == 1:
        return value
    data = json.dumps(value).encode() if group.rank == src else None
    return json.loads(broadcast_bytes(group, data, src).decode())


def broadcast_state(group: Group, states: Mapping[str, Any] | None, src: int,
                    copy: bool = True) -> tuple[dict[str, Any] | None, int]:
    """Send state dicts from ``src`` to every rank; (what arrived, bytes sent; with
    ``copy`` False its tensors are views of the received buffer where they can be).

    Two broadcasts (live/state_wire.py): the structure around the tensors (``torch.save``, read
    back ``weights_only``: a peer's bytes run no pickled code), then every tensor's bytes
    in one flat buffer on the group's device.
    """
    if group.rank == src:
        packed = state_wire.pack(dict(states or {}), group.device)
        header, data = broadcast_bytes(group, packed.header, src), packed.data
    else:
        header = broadcast_bytes(group, None, src)
        layout = state_wire.read_header(header)
        data = torch.empty(layout["size"], dtype=torch.uint8, device=group.device)
    if group.world_size > 1:
        aborts.wait(dist.broadcast(data, src, async_op=True), data)
    sent = len(header) + data.numel()
    if group.rank == src:
        return None, sent
    return state_wire.unpack(layout, data, group.device, copy=copy), sent


def sum_over_ranks(group: Group, values: torch.Tensor) -> list[float]:
    """Sum a small tensor of this rank's values over every rank (in place); its items.

    The per-step vote (worker/runtime.py) uses it: the loss and every stop flag travel in one
    all-reduce, so that every rank leaves the loop at the same step.
    """
    if group.world_size > 1:
        aborts.wait(dist.all_reduce(values, async_op=True), values)
    return values.tolist()


def gather_rows(group: Group, row: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``row`` (a small 1-d tensor of one shape and dtype on every rank), in
    rank order, on every rank."""
    if group.world_size == 1:
        return [row]
    rows = [torch.empty_like(row) for _ in range(group.world_size)]
    aborts.wait(dist.all_gather(rows, row, async_op=True), row, *rows)
    return rows


class HostNames:
    """Every rank's host name, gathered once per group (a collective: every rank asks at the
    same point), for the lines and events that name a rank's node. A new group (the world
    re-formed) gathers again on every rank: the group is known by identity, never by an
    ``id()`` that a new object may reuse (one rank gathering alone would wait forever)."""

    BYTES = 64
    """A host name as gathered (longer names are cut)."""

    def __init__(self) -> None:
        self._group: weakref.ref[Group] | None = None
        self._names: list[str] = []

    def of(self, group: Group) -> list[str]:
        if self._group is None or self._group() is not group:
            name = socket.gethostname().encode()[:self.BYTES].ljust(self.BYTES, b"\0")
            row = torch.tensor(list(name), dtype=torch.uint8, device=group.device)
            self._names = [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace")
                           for r in gather_rows(group, row)]
            self._group = weakref.ref(group)
        return self._names


def all_true(group: Group, flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank (a barrier that carries a vote)."""
    if group.world_size == 1:
        return flag
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group.device)
    aborts.wait(dist.all_reduce(vote, op=dist.ReduceOp.MIN, async_op=True), vote)
    return bool(vote.item())


def default_store() -> dist.Store | None:
    """The store the process group was formed on (for heartbeats), if torch exposes it."""
    return torch_seams.default_store()


def destroy_group() -> None:
    """Tear the group down (after every rank finished its last collective)."""
    if dist.is_initialized():
        aborts.settle_callbacks()
        dist.destroy_process_group()
