"""Every private name of torch the agent (agent/) uses, and every replacement of a torch
global it makes, in one place (``REQUIRED`` declares them; tests/unit/test_torch_seams.py
checks that the installed torch still has each, with the signature used here;
tests/unit/test_agent_seam_rule.py that no other module of agent/ touches one). The
rendezvous' own (torch's dynamic handler's internals) are in rendezvous/torch_seams.py.

The rest of the agent side calls these functions and classes, never torch's private names:

- ``TorchAgent``: torch's ``LocalElasticAgent`` with its private hooks under public names
  (``start_workers``, ``monitor_workers``, ``restart_workers``, ``stop_workers``,
  ``rendezvous``, ``assign_worker_ranks``; torch's own behaviour as
  ``torch_start_workers`` ...), for agent/live_agent.py to override;
- replacements of torch globals, each a context manager that puts the original back:
  ``agent_class_replaced`` (the launcher's agent), ``start_processes_replaced`` (how the
  local agent starts its workers), ``rendezvous_store_replaced`` (the c10d backend's
  ``TCPStore``), ``process_start_wrapped`` (``PContext.start``),
  ``finished_workers_released_on_close`` (``MultiprocessContext._close``);
- ``worker_logs_specs``: a ``DefaultLogsSpecs`` for one worker of another's;
- ``initialisation_skipped``: ``torch.nn.init``'s functions replaced by no-ops while a model
  is built on the meta device for its shapes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import PContext

from elastic_train.torch_private import Private

__all__ = ["REQUIRED", "TorchAgent", "agent_class_replaced", "failure_logging_warmed",
           "finished_workers_released_on_close", "initialisation_skipped",
           "process_start_wrapped", "rendezvous_store_replaced", "start_processes_replaced",
           "worker_logs_specs"]

_LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent"
_MP = "torch.distributed.elastic.multiprocessing.api"
REQUIRED: tuple[Private, ...] = (
    Private(_LOCAL, "LocalElasticAgent._start_workers", "overridden and called by TorchAgent "
            "(start_workers, torch_start_workers)", params=("worker_group",)),
    Private(_LOCAL, "LocalElasticAgent._monitor_workers", "overridden and called by "
            "TorchAgent (monitor_workers, torch_monitor_workers)", params=("worker_group",)),
    Private(_LOCAL, "LocalElasticAgent._restart_workers", "overridden and called by "
            "TorchAgent (restart_workers, torch_restart_workers)", params=("worker_group",)),
    Private(_LOCAL, "LocalElasticAgent._stop_workers", "overridden and called by "
            "TorchAgent (stop_workers, torch_stop_workers): the agent's own stops of its "
            "workers (a restart, restarts spent), not a signal's", params=("worker_group",)),
    Private(_LOCAL, "LocalElasticAgent._rendezvous", "overridden and called by TorchAgent "
            "(rendezvous, torch_rendezvous): to join a round while the workers run, and to "
            "go into the next round when a member was lost; also the name of the metric "
            "rendezvous/timing.py reads", params=("worker_group",)),
    Private(_LOCAL, "LocalElasticAgent._assign_worker_ranks", "overridden by TorchAgent "
            "(assign_worker_ranks): the ranks of a closed round, bounded "
            "(agent/round_ranks.py)",
            params=("store", "group_rank", "group_world_size", "spec")),
    Private(_LOCAL, "LocalElasticAgent._pcontext", "for the workers' process context "
            "(TorchAgent.process_context)"),
    Private(_LOCAL, "LocalElasticAgent._remaining_restarts", "for the restart count of the "
            "workers' store prefix (TorchAgent.restart_count)"),
    Private(_LOCAL, "start_processes", "replaced while the agent starts its workers "
            "(start_processes_replaced)",
            params=("name", "entrypoint", "args", "envs", "logs_specs")),
    Private("torch.distributed.launcher.api", "LocalElasticAgent", "replaced by the live "
            "agent's factory (agent_class_replaced)"),
    Private("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "TCPStore",
            "replaced while the c10d backend makes its store (rendezvous_store_replaced)"),
    Private(_MP, "PContext.start", "wrapped to learn each worker's rank "
            "(process_start_wrapped)"),
    Private(_MP, "MultiprocessContext._close", "wrapped to release finished workers "
            "(finished_workers_released_on_close)", params=("death_sig", "timeout")),
    Private(_MP, "MultiprocessContext._worker_finished_event", "set when the agent stops its "
            "workers (finished_workers_released_on_close)"),
    Private(_MP, "DefaultLogsSpecs._redirects", "for one worker's own logs (worker_logs_specs)"),
    Private(_MP, "DefaultLogsSpecs._tee", "(worker_logs_specs)"),
)


# ---- torch's local agent -------------------------------------------------------------------
_warming: threading.Thread | None = None


def failure_logging_warmed() -> threading.Thread:
    """torch's agent logs a failed worker with a formatter that imports ``torch._dynamo`` on
    its first exception record: 0.7-1 s of a live recovery's detection, unless imported
    before. Imported in a thread of its own, once per process, started as the agent starts
    (agent/launch.py), so that it is done before the first workers run: started once they
    ran (ed7b6f7), a worker killed in the job's first seconds waited for it (2.31 s to the
    next step, soak seed 532, against 0.2-0.3 s). On a loaded 2-core machine it shares the
    processor with a rejoining agent's rendezvous; on a real node it has a core. Returns
    that thread."""
    global _warming
    if _warming is None:
        _warming = threading.Thread(target=importlib.import_module, args=("torch._dynamo",),
                                    name="import-torch-dynamo", daemon=True)
        _warming.start()
    return _warming


class TorchAgent(LocalElasticAgent):
    """torch's ``LocalElasticAgent``, its private hooks offered under public names: a
    subclass overrides ``start_workers``, ``monitor_workers`` and ``restart_workers`` (torch
    calls them where it calls its ``_start_workers`` ...), and reaches torch's own
    behaviour through ``torch_start_workers`` ..."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.monitor_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.stop_workers(worker_group, *args, **kwargs)

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return self.torch_start_workers(worker_group)

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self.torch_monitor_workers(worker_group)

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        self.torch_restart_workers(worker_group)

    def stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.torch_stop_workers(worker_group, *args, **kwargs)

    def torch_start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return super()._start_workers(worker_group)

    def torch_monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return super()._monitor_workers(worker_group)

    def torch_restart_workers(self, worker_group: WorkerGroup) -> None:
        super()._restart_workers(worker_group)

    def torch_stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any
                           ) -> None:
        super()._stop_workers(worker_group, *args, **kwargs)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.rendezvous(worker_group)

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        return self.assign_worker_ranks(store, group_rank, group_world_size, spec)

    def rendezvous(self, worker_group: WorkerGroup) -> None:
        """Join a new rendezvous round (where torch's agent does, and while the workers
        run): torch's by default."""
        self.torch_rendezvous(worker_group)

    def torch_rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous of the agent (timed by its metric), ranks assigned by
        ``assign_worker_ranks``."""
        super()._rendezvous(worker_group)

    def assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                            spec: WorkerSpec) -> list[Worker]:
        """The workers of this member of a closed round, numbered: torch's by default."""
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    @property
    def process_context(self) -> PContext | Any:
        """The workers' process context, as torch's agent started it (None before)."""
        return self._pcontext

    @property
    def restart_count(self) -> int:
        """How many times torch's agent restarted the workers (their store prefix)."""
        return self.get_worker_group().spec.max_restarts - self._remaining_restarts


@contextlib.contextmanager
def agent_class_replaced(factory: Callable[..., LocalElasticAgent]) -> Iterator[None]:
    """While the block runs, torch's launcher builds its agent with ``factory`` (called as
    it calls ``LocalElasticAgent``)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = factory  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        api.LocalElasticAgent = original  # type: ignore[misc]


@contextlib.contextmanager
def start_processes_replaced(make: Callable[[Callable[..., PContext]], Callable[..., Any]]
                             ) -> Iterator[None]:
    """While the block runs, torch's local agent starts its workers with
    ``make(original)``, ``original`` being torch's ``start_processes``."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as module

    original = module.start_processes
    module.start_processes = make(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        module.start_processes = original


def worker_logs_specs(specs: LogsSpecs, local_rank: int) -> LogsSpecs:
    """Log destinations of one worker's own context: a folder per worker and start under
    the job's log folder (each context would otherwise write ``attempt_N/0``)."""
    root = getattr(specs, "root_log_dir", None)
    log_dir = os.path.join(root, f"local_rank_{local_rank}") \
        if root and root != os.devnull else None

    def of_this_worker(value: Any) -> Any:  # one Std for all workers, or one per local rank
        return value.get(local_rank, Std.NONE) if isinstance(value, dict) else value

    return DefaultLogsSpecs(log_dir=log_dir,
                            redirects=of_this_worker(getattr(specs, "_redirects", Std.NONE)),
                            tee=of_this_worker(getattr(specs, "_tee", Std.NONE)))


# ---- building a model for its shapes -------------------------------------------------------
INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                  "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                  "kaiming_normal_", "orthogonal_", "sparse_")
"""``torch.nn.init``'s in-place initialisations (``initialisation_skipped``)."""


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """While the block runs, ``torch.nn.init``'s initialisations leave their tensor as it
    is. For a model built on the meta device for its shapes only (the launcher's pre-check
    of a checkpoint): there they compute nothing, but the first one imports torch's
    reference implementations (``torch._refs`` and what they need), seconds of an agent's
    start-up on a loaded machine, paid again by every node that joins."""
    import torch.nn.init as init

    def left_as_is(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    saved = {name: getattr(init, name) for name in INIT_FUNCTIONS if hasattr(init, name)}
    for name in saved:
        setattr(init, name, left_as_is)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


# ---- process contexts ----------------------------------------------------------------------
@contextlib.contextmanager
def process_start_wrapped(after: Callable[[PContext], None]) -> Iterator[None]:
    """While the block runs, ``after(context)`` runs once each process context started."""
    original = PContext.start

    def start(self: Any) -> None:
        original(self)
        after(self)

    PContext.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        PContext.start = original  # type: ignore[method-assign]


@contextlib.contextmanager
def finished_workers_released_on_close() -> Iterator[None]:
    """While the block runs, closing a ``MultiprocessContext`` first sets the event its
    finished function-entrypoint workers wait for (agent/worker_start.py says why)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    original = MultiprocessContext._close

    def close(self: MultiprocessContext, *args: object, **kwargs: object) -> None:
        event = getattr(self, "_worker_finished_event", None)
        if event is not None:
            event.set()
        original(self, *args, **kwargs)

    MultiprocessContext._close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        MultiprocessContext._close = original  # type: ignore[method-assign]


# ---- the c10d rendezvous backend -----------------------------------------------------------
@contextlib.contextmanager
def rendezvous_store_replaced(make: Callable[[Callable[..., Any]], Callable[..., Any]]
                              ) -> Iterator[None]:
    """While the block runs, torch's c10d rendezvous backend makes its ``TCPStore`` with
    ``make(original)``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    original = backend.TCPStore
    backend.TCPStore = make(original)  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        backend.TCPStore = original  # type: ignore[misc]
