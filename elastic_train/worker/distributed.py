"""The process group: backend choice, reliable init under torchrun, and the few collectives.

These are the package's only collectives. Every one takes the group's timeout, and callers
reach them on every rank in the same order (the per-step vote, restore, save coordination,
shutdown).

Live recovery (worker/live_world.py) needs a collective that waits on a dead peer to end at
once, not at the timeout. On NCCL ``ProcessGroup.abort()`` does that; on gloo it does not
(measured with torch 2.13: a rank whose ring neighbour lost its own neighbour waits out the
full timeout, and ``destroy_process_group`` then blocks on the stuck work). So every wait
here, and DDP's gradient all-reduce (``abortable_allreduce_hook``), waits on a future of
our own that ``abort_collectives`` fails at once; ``abandon_group`` then drops the group
without joining its stuck work, which ends at its own timeout in the background.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import socket
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.errors import DistributedError
from elastic_train.live import state_wire
from elastic_train.live.messages import store_prefix
from elastic_train.network import advertised_loopback
from elastic_train.worker.env import WorkerEnv

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


class CollectiveAborted(DistributedError):
    """A collective was ended by ``abort_collectives`` (a peer of the group was lost)."""


_lock = threading.Lock()
_open: set[torch.futures.Future] = set()
_aborted: str | None = None
_generation = 0
"""The generation of the world this process' group belongs to (live recovery)."""
_abandoned: list[dist.ProcessGroup] = []
_callbacks_held = threading.Condition(threading.Lock())
_callbacks_pending = 0
"""Our callbacks that a backend thread ran and has not released yet (``settle_callbacks``)."""
SETTLE_SECONDS = 2.0


def _hold_callback(callback: Any) -> None:
    """Count ``callback``, which is running now, until its last reference goes."""
    global _callbacks_pending
    with _callbacks_held:
        _callbacks_pending += 1
    weakref.finalize(callback, _callback_released)


def _callback_released() -> None:
    global _callbacks_pending
    with _callbacks_held:
        _callbacks_pending -= 1
        _callbacks_held.notify_all()


def settle_callbacks(timeout: float = SETTLE_SECONDS) -> bool:
    """Wait (bounded) until no backend thread holds one of our callbacks; True if none does.

    A gloo worker thread runs a collective's done-callback, wakes the waiter, and only then
    releases the callback, which takes the GIL. If the process is finalizing by then, that
    thread cannot take it: CPython ends it inside C++ code and the process aborts with
    "terminate called without an active exception" (seen at the end of 1 in 9 resumed runs;
    the core dump showed exactly this). Waiting here, while the interpreter still runs, lets
    the release happen first. Called when the group is destroyed and at exit; skipped in a
    process that abandoned a group (its stuck work holds callbacks until its timeout, and
    such a process ends with ``os._exit``, worker/train.py).
    """
    if _abandoned:
        return False
    with _callbacks_held:
        return _callbacks_held.wait_for(lambda: _callbacks_pending <= 0, timeout)


atexit.register(settle_callbacks)


def _abortable(future: torch.futures.Future) -> torch.futures.Future:
    """A future that completes with ``future``, or fails at once on ``abort_collectives``."""
    mine: torch.futures.Future = torch.futures.Future()
    with _lock:
        if _aborted is not None:
            mine.set_exception(CollectiveAborted(_aborted))
            return mine
        _open.add(mine)

    def done(result: torch.futures.Future) -> None:
        running = me()
        if running is not None:  # the backend thread releases it after this returns
            _hold_callback(running)
            del running
        with _lock:
            if mine not in _open:
                return  # aborted first
            _open.discard(mine)
        try:
            mine.set_result(result.value())
        except Exception as exc:  # the collective's own error (a peer reset the connection)
            # Without its traceback: that holds this frame, which holds this function.
            mine.set_exception(exc.with_traceback(None))

    me = weakref.ref(done)
    future.add_done_callback(done)
    return mine


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        _abortable(work.get_future()).wait()


def abort_collectives(reason: str, generation: int | None = None) -> None:
    """Fail every collective waited on now, and every one started later in this group, with
    ``CollectiveAborted(reason)`` (any thread; live recovery's watcher calls it).

    ``generation``: the world that replaces this one; ignored when this process' group
    already belongs to it (the watcher saw it just before the group was formed).
    """
    global _aborted
    with _lock:
        if generation is not None and generation <= _generation:
            return
        _aborted = reason
        pending = list(_open)
        _open.clear()
    for future in pending:
        future.set_exception(CollectiveAborted(reason))


_PEER_LOST = ("connection", "peer", "timed out", "nccl", "gloo")
"""Words of a backend's error about a lost peer (compared in lower case)."""


def is_collective_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it came from) is a collective that failed or was aborted
    (a peer lost, a timeout, ``abort_collectives``), not an error of the loop's own code:
    live recovery asks the agents to re-form only for the former."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (CollectiveAborted, dist.DistError)):
            return True
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def abortable_allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: the default gradient mean, through an abortable future.

    Scales by ``1 / world`` before summing, as DDP's built-in path does, so the gradients
    are bit for bit those of DDP without a hook.
    """
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return _abortable(work.get_future()).then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations against the types themselves, not their names.
abortable_allreduce_hook.__annotations__ = {
    "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class StepFailures:
    """The first collective failure of the step in flight, as a forgiving gradient
    all-reduce saw it (``forgiving_allreduce_hook``; ElasticSession's DDP)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def take(self) -> BaseException | None:
        """The failure of the step in flight (None: it had none), and forget it."""
        error, self.error = self.error, None
        return error


def forgiving_allreduce_hook(state: StepFailures, bucket: dist.GradBucket
                             ) -> torch.futures.Future:
    """DDP communication hook: ``abortable_allreduce_hook``'s gradient mean, but a failed or
    aborted all-reduce is recorded in ``state`` instead of raised, so that a hand-written
    loop's ``backward()`` returns; the session then skips the optimizer step (its grads
    are garbage) and re-forms the world (worker/session.py)."""
    buffer = bucket.buffer()

    def settle(result: torch.futures.Future) -> torch.Tensor:
        try:
            return result.value()[0]
        except Exception as exc:
            state.error = state.error or exc.with_traceback(None)
            return buffer

    try:
        if _aborted is not None:  # no collective on a world that is being left: its work
            # would outlive the step, and a gloo group freed while its thread still ends
            # that work deadlocks on the GIL (seen in a test that dropped such a group)
            raise CollectiveAborted(_aborted)
        buffer.mul_(1.0 / dist.get_world_size())
        work = dist.all_reduce(buffer, async_op=True)
    except Exception as exc:  # the group already failed (aborted, or its peer is gone)
        state.error = state.error or exc
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_result(buffer)
        return failed
    return _abortable(work.get_future()).then(settle)


forgiving_allreduce_hook.__annotations__ = {
    "state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def renew_ddp(ddp: DistributedDataParallel) -> None:
    """Move ``ddp`` to this process' new default group (the world re-formed in place) with
    a new reducer, as DDP builds one when it is unpickled (its ``__setstate__``).

    Not ``DDP._update_process_group``: that keeps the buckets rebuilt in the first
    iteration, in the order the gradients came, while a DDP built anew in a worker that
    joins starts with the default order; the two would reduce different parameters' slots
    together. Every member renews, so every member's buckets are the same. The comm hooks
    registered before are registered again.
    """
    ddp.reducer._remove_autograd_hooks()
    ddp.process_group = dist.group.WORLD
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(parameters, expect_sparse_gradient,
                         ddp._build_debug_param_to_name_mapping(parameters), ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._has_rebuilt_buckets = False
    for hook, state in ddp._comm_hooks:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)


def abandon_group() -> None:
    """Drop this worker's group after a lost peer, without waiting for its stuck work.

    NCCL's communicators are aborted; gloo's stuck waits end at the group's timeout on
    threads nobody joins. The group is kept referenced until the process ends so that
    no destructor joins them (worker/train.py ends such a process with ``os._exit``).
    """
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    with contextlib.suppress(Exception):
        group.abort()
    _abandoned.append(group)
    shutdown = dist.ProcessGroup.__dict__["shutdown"]  # the descriptor, to put back as is
    dist.ProcessGroup.shutdown = lambda self: None  # type: ignore[method-assign]
    try:
        dist.destroy_process_group()
    finally:
        dist.ProcessGroup.shutdown = shutdown  # type: ignore[method-assign]


def abandoned_groups() -> int:
    """How many groups this process dropped with work stuck in them."""
    return len(_abandoned)


_retained: list[dist.ProcessGroup] = []
"""Groups a user's script destroyed, kept referenced until its process ends (below)."""


@contextlib.contextmanager
def groups_kept_until_exit() -> Iterator[None]:
    """While the block runs, ``destroy_process_group`` keeps a reference to every group it
    destroys, so that no gloo group is ever freed in this process: it must end with
    ``os._exit`` (worker/script_worker.py).

    Why: a gloo collective launched during ``backward()`` carries autograd's thread-local
    state, which holds a Python object (the ``contextvars`` context that
    ``torch.autograd.graph._engine_run_backward`` stashes there). gloo's worker thread
    frees that work after it completes, which takes the GIL. ``~ProcessGroupGloo`` joins
    that thread while the freeing thread (the main one, dropping the last reference to
    DDP's reducer or to the group, e.g. when ``main()`` of a tutorial script returns after
    ``destroy_process_group()``) holds the GIL: a deadlock whenever the group goes away
    within the few milliseconds after the last backward (gdb, torch 2.13; 2 of 14 runs of
    a tutorial script here). Nothing outside torch can make that destructor release the
    GIL or know when the worker thread is done, so the group is never destroyed; its
    threads and sockets go with the process. A script that destroys many groups keeps
    them all until it ends (one per destroy; an ElasticSession, one per re-formation).
    """
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group

    def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
        _retained.extend(_groups_destroyed_by(group))
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = c10d.destroy_process_group = original


def _groups_destroyed_by(group: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """The groups ``destroy_process_group(group)`` drops: ``group``, or with None (or the
    world) every group of this process (torch 2.13's ``_world.pg_map``; the world group
    alone if that changes)."""
    if group is not None and group is not dist.GroupMember.WORLD:
        return [group]
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if isinstance(pg_map, Mapping):
        return list(pg_map)
    return [g for g in (dist.GroupMember.WORLD,) if g is not None]


def retained_groups() -> int:
    """How many groups ``groups_kept_until_exit`` kept from being freed."""
    return len(_retained)


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
    global _aborted, _generation
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
    with _lock:
        _aborted = None
        _generation = generation
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
        dist.distributed_c10d._world.group_count = 0
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
        _wait(dist.barrier(async_op=True,
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
    _wait(dist.broadcast(size, src, async_op=True))
    if group.rank == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(group.device)  # type: ignore[arg-type]
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=group.device)
    _wait(dist.broadcast(buffer, src, async_op=True))
    return data if group.rank == src else buffer.cpu().numpy().tobytes()  # type: ignore[return-value]


def broadcast_json(group: Group, value: Any, src: int = 0) -> Any:
    """Send a JSON-able value from ``src`` to every rank (no pickle on the wire)."""
    if group.world_size == 1:
        return value
    data = json.dumps(value).encode() if group.rank == src else None
    return json.loads(broadcast_bytes(group, data, src).decode())


def broadcast_state(group: Group, states: Mapping[str, Any] | None, src: int
                    ) -> tuple[dict[str, Any] | None, int]:
    """Send state dicts from ``src`` to every rank; (what arrived, bytes sent).

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
        _wait(dist.broadcast(data, src, async_op=True))
    sent = len(header) + data.numel()
    if group.rank == src:
        return None, sent
    return state_wire.unpack(layout, data, group.device), sent


def sum_over_ranks(group: Group, values: torch.Tensor) -> list[float]:
    """Sum a small tensor of this rank's values over every rank (in place); its items.

    The per-step vote (worker/runtime.py) uses it: the loss and every stop flag travel in one
    all-reduce, so that every rank leaves the loop at the same step.
    """
    if group.world_size > 1:
        _wait(dist.all_reduce(values, async_op=True))
    return values.tolist()


def all_true(group: Group, flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank (a barrier that carries a vote)."""
    if group.world_size == 1:
        return flag
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group.device)
    _wait(dist.all_reduce(vote, op=dist.ReduceOp.MIN, async_op=True))
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
        settle_callbacks()
        dist.destroy_process_group()
