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
import threading
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


def wait(work: dist.Work | None) -> None:
    """Wait for ``work`` (a collective of distributed.py) through an abortable future."""
    if work is not None:
        abortable(work.get_future()).wait()


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
