"""Ending a process group's work early, and leaving a group that cannot end normally.

Live recovery needs a collective that waits on a dead peer to end at once, not at the
timeout. On NCCL ``ProcessGroup.abort()`` does that; on gloo it does not (measured with
torch 2.13: a rank whose ring neighbour lost its own neighbour waits out the full timeout,
and ``destroy_process_group`` then blocks on the stuck work). So every wait of
distributed.py, and DDP's gradient all-reduce (data_parallel.py), waits on a future of our own that
``abort_collectives`` fails at once; ``abandon_group`` then drops the group without joining
its stuck work, which ends at its own timeout in the background. ``settle_callbacks`` and
``groups_kept_until_exit`` keep gloo's threads from aborting or deadlocking the process
when a group goes away.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.errors import DistributedError
from elastic_train.worker import torch_seams

__all__ = ["SETTLE_SECONDS", "CollectiveAborted", "abandon_group", "abandoned_groups",
           "abort_collectives", "aborted", "enter_generation", "groups_kept_until_exit",
           "is_collective_failure", "retained_groups", "settle_callbacks", "wait"]


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
_handed: dict[int, torch.Tensor] = {}
"""Tensors our collectives were given, kept until no work holds them (``_hand_over``)."""
_handed_lock = threading.Lock()
SETTLE_SECONDS = 2.0
SETTLE_POLL_SECONDS = 0.001


def _hold_callback(callback: Any) -> None:
    """Count ``callback``, which is running now, until its last reference goes."""
    global _callbacks_pending
    with _callbacks_held:
        _callbacks_pending += 1
    # Not called at exit: weakref's own atexit hook would run before settle_callbacks'
    # and count every callback released.
    weakref.finalize(callback, _callback_released).atexit = False


def _callback_released() -> None:
    global _callbacks_pending
    with _callbacks_held:
        _callbacks_pending -= 1
        _callbacks_held.notify_all()


def _hand_over(*tensors: torch.Tensor) -> None:
    """Keep the tensors given to a collective until no work of the backend holds them, so
    that this thread frees them, never a backend thread (``settle_callbacks``). For
    tensors made for the collective: one its caller keeps stays here while it is kept."""
    with _handed_lock:
        for tensor in tensors:
            _handed[id(tensor)] = tensor
    _take_released()  # freed here, outside the lock (freeing one may release the GIL)


def _take_released() -> list[torch.Tensor]:
    """Take the tensors that no work holds any longer out of ``_handed``."""
    with _handed_lock:
        return [_handed.pop(key) for key in [k for k in _handed if not _held_by_backend(k)]]


def _held_by_backend(key: int) -> bool:
    """Whether a work holds the tensor ``_handed[key]``, or has not yet let go of its
    Python object: torch keeps a tensor's Python object referenced while C++ holds the
    tensor, and the C++ side's last release drops that reference under the GIL, on the
    thread that released it, after it dropped its own count."""
    return torch_seams.tensor_use_count(_handed[key]) > 1 or \
        _references(_handed, key) > _ALONE


def _references(tensors: dict[int, torch.Tensor], key: int) -> int:
    return sys.getrefcount(tensors[key])


_ALONE = _references({0: torch.empty(0)}, 0)
"""The references to a tensor that its dict alone holds, counted as ``_held_by_backend``
counts them."""


def settle_callbacks(timeout: float = SETTLE_SECONDS) -> bool:
    """Wait (bounded) until no backend thread holds one of our callbacks or one of the
    tensors our collectives were given; True if none does.

    A gloo worker thread runs a collective's done-callback, wakes the waiter, and only then
    releases the callback, which takes the GIL. If the process is finalizing by then, that
    thread cannot take it: CPython ends it inside C++ code and the process aborts with
    "terminate called without an active exception" (seen at the end of 1 in 9 resumed runs;
    the core dump showed exactly this). Waiting here, while the interpreter still runs, lets
    the release happen first. Called when the group is destroyed and at exit; skipped in a
    process that abandoned a group (its stuck work holds callbacks until its timeout, and
    such a process ends with ``os._exit``, worker/train.py).

    The tensors, the same way: a work that is freed lets go of the Python objects of the
    tensors it was given, under the GIL; and a gloo barrier keeps (weakly) the works in
    flight when it was called, so those are freed only with the barrier's work, on gloo's
    thread after the barrier's waiter woke. A hand-written loop stopped by SIGTERM votes,
    meets at that barrier and ends milliseconds later: rank 1 of the README's tutorial
    under torchrun aborted so in 6 of 180 runs, and torchrun restarted the job (cores:
    Py_FinalizeEx on the main thread; ~AsyncBarrierWork -> ~AsyncAllreduceWork ->
    TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate on gloo's).
    A finalizer on the tensor is no witness: it runs while its Python object is freed,
    and freeing a tensor releases the GIL and takes it again (THPVariable_clear), which
    aborted the same way (3 of 60 runs; 2 cores). So ``_handed`` keeps every tensor until
    the backend let go of it (polled: nothing tells), and this thread frees it: 0 of 180.
    """
    if _abandoned:
        return False
    deadline = time.monotonic() + timeout
    while True:
        _take_released()  # freed here, outside both locks
        with _callbacks_held:
            if _callbacks_pending <= 0 and not _handed:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _callbacks_held.wait(min(left, SETTLE_POLL_SECONDS))


atexit.register(settle_callbacks)


def abortable(future: torch.futures.Future) -> torch.futures.Future:
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


def wait(work: dist.Work | None, *tensors: torch.Tensor) -> None:
    """Wait for ``work`` (a collective of distributed.py), which was given ``tensors``,
    through an abortable future; the tensors are kept until the backend lets go of them
    (``settle_callbacks``)."""
    if work is not None:
        _hand_over(*tensors)
        abortable(_future_of(work)).wait()


def _future_of(work: dist.Work) -> torch.futures.Future:
    """``work``'s future; for work that has none (gloo's reduce-scatter), one that a thread
    of its own completes when ``work.wait()`` returns (abandoned with the group when the
    work is stuck on a lost peer: it ends at the group's timeout)."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        pass
    future: torch.futures.Future = torch.futures.Future()

    def wait_for_it() -> None:
        try:
            work.wait()
        except Exception as exc:  # the collective's own error reaches the waiter
            future.set_exception(exc.with_traceback(None))
        else:
            future.set_result(None)

    threading.Thread(target=wait_for_it, name="elastic-train-work-wait", daemon=True).start()
    return future


def enter_generation(generation: int) -> None:
    """A new group is formed for world ``generation``: collectives may run again, and an
    abort for this world or an older one is ignored (distributed.init_group)."""
    global _aborted, _generation
    with _lock:
        _aborted = None
        _generation = generation


def aborted() -> str | None:
    """Why this world's collectives were aborted; None while they may run."""
    return _aborted


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
_WRAPPED = tuple(f"{kind.__name__}:" for kind in (CollectiveAborted, dist.DistError,
                                                   dist.DistBackendError, dist.DistNetworkError,
                                                   dist.DistStoreError))
"""How a failure keeps its type in a torch future's error: a callback chained on a failed
future (``Future.then``, as DDP's communication hook's) raises ``RuntimeError("Got the
following error when running the callback: CollectiveAborted: ...")``, the original
exception neither its cause nor its context (the soak of 211e9c6: 27 such steps read as
the loop's own errors; no time lost, as their re-formation was announced already)."""


def is_collective_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it came from) is a collective that failed or was aborted
    (a peer lost, a timeout, ``abort_collectives``), not an error of the loop's own code:
    live recovery asks the agents to re-form only for the former."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (CollectiveAborted, dist.DistError)):
            return True
        if isinstance(exc, RuntimeError) and (any(w in str(exc).lower() for w in _PEER_LOST)
                                              or any(w in str(exc) for w in _WRAPPED)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False

def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` (for one line about a failure)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def abandon_group() -> None:
    """Drop this worker's group after a lost peer, without waiting for its stuck work.

    NCCL's communicators are aborted; gloo's stuck waits end at the group's timeout on
    threads nobody joins. The groups are kept referenced until the process ends so that
    no destructor joins them (worker/train.py ends such a process with ``os._exit``):
    the world's, and those a device mesh made from it (HSDP's replica and shard groups).
    """
    if not dist.is_initialized():
        return
    groups = torch_seams.groups_of_this_process() or [dist.group.WORLD]
    for group in groups:
        with contextlib.suppress(Exception):
            group.abort()
    _abandoned.extend(groups)
    with torch_seams.group_shutdown_skipped():
        dist.destroy_process_group()


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
    def keep(group: dist.ProcessGroup | None) -> None:
        _retained.extend(_groups_destroyed_by(group))

    with torch_seams.destroy_process_group_preceded_by(keep):
        yield


def _groups_destroyed_by(group: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """The groups ``destroy_process_group(group)`` drops: ``group``, or with None (or the
    world) every group of this process (torch 2.13's ``_world.pg_map``; the world group
    alone if that changes)."""
    if group is not None and group is not dist.GroupMember.WORLD:
        return [group]
    groups = torch_seams.groups_of_this_process()
    if groups is not None:
        return groups
    return [g for g in (dist.GroupMember.WORLD,) if g is not None]


def retained_groups() -> int:
    """How many groups ``groups_kept_until_exit`` kept from being freed."""
    return len(_retained)
