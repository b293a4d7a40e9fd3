"""Live recovery, the agent's side: start again only the worker that died.

torch's ``LocalElasticAgent`` starts a node's workers as one process context, and a
context whose process fails closes the rest: any failure restarts every worker from the
newest checkpoint. ``LiveRecoveryAgent`` starts each worker in a context of its own
(``PerWorkerProcesses``). When some workers fail while others of the world still run, it
announces a new generation of the world in its store (``live_recovery.GENERATION_KEY``)
and starts only the failed ones again; the survivors keep their processes and state, and
the world re-forms in place (live_recovery.py, runtime.WorkerRuntime.rejoin).

It falls back to torch's restart path, unchanged, when live recovery cannot help: every
worker failed (no one holds the state), the world had not restored its state yet or had
left the training loop, the job asked for ``--recovery restart``, the
workers do not share the agent's store, or the job has several nodes (each node's agent
sees only its own workers; re-forming across agents is not built yet). Live restarts are
bounded by ``--max-restarts`` like group restarts, so a worker that fails again and again
ends in the restart path, then the job's failure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult

from elastic_train.distributed import store_prefix
from elastic_train.env import LIVE_GENERATION, LIVE_RECOVERY, LIVE_STORE
from elastic_train.live_recovery import FINISHED_KEY, GENERATION_KEY, READY_KEY, failure_key

log = logging.getLogger(__name__)

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LIVE_NCCL_ERROR_HANDLING = "2"
"""What live workers get unless the job set it: on an NCCL error, abort the communicator
and keep the process (torch's agent passes 1: abort and tear the process down, which would
end the survivors that live recovery keeps). A collective that hangs is the step
watchdog's to end (``--step-timeout``)."""


class PerWorkerProcesses:
    """A node's workers, each in a process context of its own, so that one can fail and be
    started again while the others run. Offers what torch's agent uses of a ``PContext``.
    """

    def __init__(self, start_one: Callable[[int, dict[str, str]], PContext],
                 envs: dict[int, dict[str, str]]) -> None:
        self._start_one = start_one
        self._envs = envs
        self._running: dict[int, PContext] = {lr: start_one(lr, env) for lr, env in envs.items()}
        self._pids = {lr: ctx.pids()[0] for lr, ctx in self._running.items()}
        self._results: dict[int, RunProcsResult] = {}

    def pids(self) -> dict[int, int]:
        """Each worker's pid (the last one of a worker that ended)."""
        return dict(self._pids)

    def poll_failed(self) -> tuple[dict[int, Any], int]:
        """Poll every running worker: (the newly failed ones' failures by local rank, how
        many still run)."""
        failed: dict[int, Any] = {}
        for lr, ctx in list(self._running.items()):
            result = ctx.wait(0)
            if result is None:
                continue
            del self._running[lr]
            self._results[lr] = result
            if result.is_failed():
                failure = next(iter(result.failures.values()))
                failure.local_rank = lr
                failed[lr] = failure
        return failed, len(self._running)

    def restart(self, local_rank: int, extra_env: dict[str, str]) -> int:
        """Start worker ``local_rank`` again (it failed); its new pid."""
        self._results.pop(local_rank, None)
        env = {**self._envs[local_rank], **extra_env}
        self._running[local_rank] = self._start_one(local_rank, env)
        self._pids[local_rank] = self._running[local_rank].pids()[0]
        return self._pids[local_rank]

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """What a ``PContext`` returns: a failure as soon as one worker failed, every
        return value once all succeeded, else None."""
        deadline = time.monotonic() + (timeout if timeout >= 0 else float("inf"))
        while True:
            self.poll_failed()
            failures = {lr: next(iter(r.failures.values()))
                        for lr, r in self._results.items() if r.is_failed()}
            if failures:
                return RunProcsResult(failures=failures)
            if not self._running:
                return RunProcsResult(return_values={
                    lr: r.return_values.get(0) for lr, r in self._results.items()})
            if time.monotonic() >= deadline:
                return None
            time.sleep(period)

    def close(self, death_sig: Any = None, timeout: int = 30) -> None:
        for ctx in self._running.values():
            ctx.close(death_sig, timeout)
        self._running.clear()


def live_worker_env(env: dict[str, str], live_store: str,
                    agent_env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A worker's environment under live recovery: torch's, plus our agent's store, plus
    NCCL's error handling that keeps survivors alive unless the job set its own."""
    nccl = {} if NCCL_ERROR_HANDLING in agent_env \
        else {NCCL_ERROR_HANDLING: LIVE_NCCL_ERROR_HANDLING}
    return {**env, LIVE_RECOVERY: "1", LIVE_STORE: live_store, **nccl}


def _worker_logs_specs(specs: LogsSpecs, local_rank: int) -> LogsSpecs:
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


class LiveRecoveryAgent(LocalElasticAgent):
    """torch's local agent, with workers started again one by one (see the module)."""

    recovery = "live"
    """'live' or 'restart' (the job's --recovery); set by ``live_agent_installed``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live_left = self._worker_group.spec.max_restarts
        self._live_store: dist.TCPStore | None = None
        self._said_why_not = False

    # ---- starting ---------------------------------------------------------------------------
    def _live_possible(self, worker_group: WorkerGroup) -> str | None:
        """None when this group's workers can be started again one by one, else why not."""
        if self.recovery != "live":
            return "--recovery restart"
        if worker_group.group_world_size != 1:
            return "the job has several nodes (live recovery across nodes is not built yet)"
        return None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        why_not = self._live_possible(worker_group)
        if why_not is not None:
            if self.recovery == "live" and not self._said_why_not:
                log.warning("live recovery is off (%s): a failed worker restarts every "
                            "worker from the newest checkpoint", why_not)
                self._said_why_not = True
            return super()._start_workers(worker_group)
        if self._live_store is None:  # for the agent's life; keys carry the restart count
            self._live_store = dist.TCPStore(worker_group.master_addr or "127.0.0.1", 0,
                                             is_master=True, wait_for_workers=False,
                                             timeout=timedelta(seconds=60))
        with self._per_worker_contexts(f"{worker_group.master_addr or '127.0.0.1'}:"
                                       f"{self._live_store.port}"):
            return super()._start_workers(worker_group)

    @contextlib.contextmanager
    def _per_worker_contexts(self, live_store: str) -> Iterator[None]:
        """While the base class starts the workers: one context per worker, the workers
        told that the agent restarts them one by one."""
        from torch.distributed.elastic.agent.server import local_elastic_agent as module

        original = module.start_processes

        def start_processes(name: str, entrypoint: Any, args: dict[int, tuple],
                            envs: dict[int, dict[str, str]], logs_specs: LogsSpecs,
                            **kwargs: Any) -> PerWorkerProcesses:
            kwargs.pop("log_line_prefixes", None)

            def start_one(local_rank: int, env: dict[str, str]) -> PContext:
                return original(name=name, entrypoint=entrypoint, args={0: args[local_rank]},
                                envs={0: env}, logs_specs=_worker_logs_specs(logs_specs,
                                                                             local_rank),
                                **kwargs)

            return PerWorkerProcesses(start_one, {
                lr: live_worker_env(env, live_store) for lr, env in envs.items()})

        module.start_processes = start_processes  # type: ignore[assignment]
        try:
            yield
        finally:
            module.start_processes = original

    # ---- watching ---------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        workers = self._pcontext
        if isinstance(workers, PerWorkerProcesses):
            failed, running = workers.poll_failed()
            if failed and running and self._live_left > 0 \
                    and self._in_training(self._store_of_workers(worker_group)):
                self._restart_in_place(worker_group, workers, failed)
                return RunResult(state=WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)

    @staticmethod
    def _in_training(store: dist.Store) -> bool:
        """The workers hold their state (restored) and have not left the loop: a lost one
        can be replaced in place."""
        return store.check([READY_KEY]) and not store.check([FINISHED_KEY])

    def _restart_in_place(self, worker_group: WorkerGroup, workers: PerWorkerProcesses,
                          failed: dict[int, Any]) -> None:
        """Announce a new generation of the world, then start the failed workers into it."""
        self._live_left -= 1
        ranks = sorted(worker_group.workers[lr].global_rank for lr in failed)
        store = self._store_of_workers(worker_group)
        generation = int(store.add(GENERATION_KEY, 0)) + 1
        store.set(failure_key(generation), json.dumps(
            {"ranks": ranks, "detected_at": time.time(),
             "exit_codes": [f.exitcode for f in failed.values()]}))
        store.add(GENERATION_KEY, 1)
        for local_rank in failed:
            pid = workers.restart(local_rank, {LIVE_GENERATION: str(generation)})
            worker_group.workers[local_rank].id = pid
        log.warning("worker rank(s) %s failed (exit code %s): started again into the running "
                    "world (live recovery, generation %d; %d live restart(s) left)",
                    ranks, [f.exitcode for f in failed.values()], generation, self._live_left)

    def _store_of_workers(self, worker_group: WorkerGroup) -> dist.Store:
        """The live-recovery store, under the prefix this incarnation's workers use
        (distributed.store_prefix)."""
        assert self._live_store is not None
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        return dist.PrefixStore(store_prefix(spec.rdzv_handler.get_run_id(), restart_count),
                                self._live_store)


@contextlib.contextmanager
def live_agent_installed(recovery: str) -> Iterator[None]:
    """Make torch's launcher run ``LiveRecoveryAgent`` (for ``elastic-train run``)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    LiveRecoveryAgent.recovery = recovery
    api.LocalElasticAgent = LiveRecoveryAgent  # type: ignore[misc]
    try:
        yield
    finally:
        api.LocalElasticAgent = original  # type: ignore[misc]
