"""A node's workers under live recovery, each in a process context of its own
(``PerWorkerProcesses``), so that one can fail and be started again, or be replaced by the
hot spare (live/spare.py), while the others run; and the environment they start with
(``live_worker_env``). The live agent (agent/live_agent.py) makes torch's local agent start
its workers this way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult

from elastic_train.agent.torch_seams import start_processes_replaced, worker_logs_specs
from elastic_train.live.environment import LIVE_GENERATION, LIVE_RECOVERY, LIVE_STORE
from elastic_train.live.spare import assign, spare_delay, spare_env

log = logging.getLogger(__name__)

SPARE_ENDS = 2
"""Spares that may end on their own before the agent stops making them."""
SPARE_DISMISS_SECONDS = 2.0
"""How long a dismissed spare may take to exit before it is killed."""
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
                 envs: dict[int, dict[str, str]], spare_store: dist.Store | None = None
                 ) -> None:
        self._start_one = start_one
        self._envs = envs
        self._running: dict[int, PContext] = {lr: start_one(lr, env) for lr, env in envs.items()}
        self._pids = {lr: ctx.pids()[0] for lr, ctx in self._running.items()}
        self._results: dict[int, RunProcsResult] = {}
        self._ended_here: set[int] = set()
        """Local ranks this node's agent ended itself (``end_now``): gone, they are not
        failures (none of --max-restarts is spent on them) and never a success."""
        self._hold = False
        self._spare_store = spare_store
        """Where spares are given their place (live/spare.py); None: no spares."""
        self._spare: PContext | None = None
        self._spare_delay = spare_delay()
        self._spare_due = time.monotonic() + self._spare_delay
        self._spare_ends = 0

    def pids(self, running_only: bool = False) -> dict[int, int]:
        """Each worker's pid (the last one of a worker that ended, unless ``running_only``)."""
        if running_only:
            return {lr: pid for lr, pid in self._pids.items() if lr in self._running}
        return dict(self._pids)

    @contextlib.contextmanager
    def as_polled(self) -> Iterator[None]:
        """While torch's monitor looks: ``wait`` reports what the last ``poll_failed``
        found and polls nothing (a failure found there would take torch's restart path,
        which stops every worker, before live recovery saw it)."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False

    def running(self) -> list[int]:
        """The local ranks whose process runs (as of the last poll)."""
        return list(self._running)

    def poll_failed(self) -> tuple[dict[int, Any], int]:
        """Poll every running worker: (the newly failed ones' failures by local rank, how
        many still run)."""
        failed: dict[int, Any] = {}
        for lr, ctx in list(self._running.items()):
            result = ctx.wait(0)
            if result is None:
                continue
            del self._running[lr]
            if lr in self._ended_here:  # its agent ended it: no failure, no result
                continue
            self._results[lr] = result
            if result.is_failed():
                failure = next(iter(result.failures.values()))
                failure.local_rank = lr
                failed[lr] = failure
        return failed, len(self._running)

    def ended_here(self) -> list[int]:
        """The local ranks whose workers this agent ended itself (``end_now``) and that
        are gone (as of the last poll): the agent's own stop, which must not count as the
        workers' failure (the fault campaign, c10d seed 642: counted, it spent
        --max-restarts and the second cut-off ended the job)."""
        return sorted(lr for lr in self._ended_here if lr not in self._running)

    def restart(self, local_rank: int, extra_env: dict[str, str]) -> int:
        """Start worker ``local_rank`` again (it failed): the spare takes its place if one
        runs, else a new process is forked; its new pid."""
        self._results.pop(local_rank, None)
        self._ended_here.discard(local_rank)
        env = {**self._envs[local_rank], **extra_env}
        spare = self._take_spare()
        if spare is not None:
            assert self._spare_store is not None
            assign(self._spare_store, spare.pids()[0], env)
            self._running[local_rank] = spare
        else:
            self._running[local_rank] = self._start_one(local_rank, env)
        self._pids[local_rank] = self._running[local_rank].pids()[0]
        return self._pids[local_rank]

    def wants_spare(self) -> bool:
        """Whether a spare should be started now (none runs, and one is due)."""
        if self._spare_store is None:
            return False
        self._spare_ended()
        return self._spare is None and self._spare_ends < SPARE_ENDS \
            and time.monotonic() >= self._spare_due

    def start_spare(self) -> int:
        """Fork a spare now (``hot_spare``): the environment of the lowest local rank, marked
        as a spare. Its pid."""
        template = min(self._envs)
        self._spare = self._start_one(template, spare_env(self._envs[template]))
        return self._spare.pids()[0]

    def _take_spare(self) -> PContext | None:
        if self._spare_ended() or self._spare is None:
            return None
        spare, self._spare = self._spare, None
        self._spare_due = time.monotonic() + self._spare_delay
        return spare

    def _spare_ended(self) -> bool:
        """Whether the spare ended on its own (killed, or it could not build): then it is
        counted, said and forgotten, and the next one is due after the delay."""
        if self._spare is None or self._spare.wait(0) is None:
            return False
        self._spare = None
        self._spare_ends += 1
        self._spare_due = time.monotonic() + self._spare_delay
        log.warning("the hot spare ended before it was needed (%d of %d): %s",
                    self._spare_ends, SPARE_ENDS, "another is started later"
                    if self._spare_ends < SPARE_ENDS else "no more spares")
        return True

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """What a ``PContext`` returns: a failure as soon as one worker failed, every
        return value once all succeeded, else None."""
        deadline = time.monotonic() + (timeout if timeout >= 0 else float("inf"))
        while True:
            if not self._hold:
                self.poll_failed()
            failures = {lr: next(iter(r.failures.values()))
                        for lr, r in self._results.items() if r.is_failed()}
            if failures:
                return RunProcsResult(failures=failures)
            if self.ended_here():  # neither a failure nor a success: the agent decides
                return None
            if not self._running:
                return RunProcsResult(return_values={
                    lr: r.return_values.get(0) for lr, r in self._results.items()})
            if time.monotonic() >= deadline:
                return None
            time.sleep(period)

    def end_now(self) -> None:
        """SIGKILL every worker (not the spare): a world that went on without them
        superseded their state, and they may wait in one of its collectives, where a
        SIGTERM would wait out the preemption budget. The restart path starts them anew.
        Their exits are this agent's doing, never a failure (``ended_here``)."""
        self._ended_here.update(self._running)
        for ctx in self._running.values():
            ctx.close(signal.SIGKILL, 5)

    def close(self, death_sig: Any = None, timeout: int = 30) -> None:
        """Stop the workers, then the spare. The workers first: a SIGTERM (a preemption)
        must reach them at once, and a second signal that interrupts this must not leave
        one running; a spare left behind exits once this agent's store is gone."""
        spare, self._spare = self._spare, None
        try:
            for ctx in self._running.values():
                ctx.close(death_sig, timeout)
            self._running.clear()
        finally:  # whatever happened above, no spare outlives its agent
            if spare is not None:
                self._dismiss(spare)
                spare.close(death_sig, timeout)

    def _dismiss(self, spare: PContext) -> None:
        """Tell an idle spare to exit (an empty place), and give it a moment: killed, it
        would be logged by torch as a worker closed by a signal. The store not answering,
        the caller closes it at once."""
        assert self._spare_store is not None
        try:
            assign(self._spare_store, spare.pids()[0], {})
        except (RuntimeError, OSError):
            return
        spare.wait(SPARE_DISMISS_SECONDS, period=0.01)


def live_worker_env(env: dict[str, str], live_store: str, generation: int = 0,
                    agent_env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A worker's environment under live recovery: torch's, plus our agent's store and the
    generation it starts into (its plan is there), plus NCCL's error handling that keeps
    survivors alive unless the job set its own."""
    nccl = {} if NCCL_ERROR_HANDLING in agent_env \
        else {NCCL_ERROR_HANDLING: LIVE_NCCL_ERROR_HANDLING}
    return {**env, LIVE_RECOVERY: "1", LIVE_STORE: live_store,
            LIVE_GENERATION: str(generation), **nccl}


def per_worker_start(live_store: str, generation: int, watch: Callable[[int], None],
                     spare_store: dist.Store | None
                     ) -> Callable[[Callable[..., PContext]], Callable[..., PerWorkerProcesses]]:
    """What replaces torch's ``start_processes`` while the live agent starts its workers
    (torch_seams.start_processes_replaced): one context per worker (``watch``: each pid),
    the workers told that the agent restarts them one by one (``live_worker_env``)."""
    def make(original: Callable[..., PContext]) -> Callable[..., PerWorkerProcesses]:
        def start_processes(name: str, entrypoint: Any, args: dict[int, tuple],
                            envs: dict[int, dict[str, str]], logs_specs: LogsSpecs,
                            **kwargs: Any) -> PerWorkerProcesses:
            kwargs.pop("log_line_prefixes", None)

            def start_one(local_rank: int, env: dict[str, str]) -> PContext:
                context = original(name=name, entrypoint=entrypoint,
                                   args={0: args[local_rank]}, envs={0: env},
                                   logs_specs=worker_logs_specs(logs_specs, local_rank),
                                   **kwargs)
                for pid in context.pids().values():
                    watch(pid)
                return context

            return PerWorkerProcesses(start_one, {
                lr: live_worker_env(env, live_store, generation) for lr, env in envs.items()},
                spare_store=spare_store)

        return start_processes

    return make


@contextlib.contextmanager
def per_worker_contexts(live_store: str, generation: int, watch: Callable[[int], None],
                        spare_store: dist.Store | None) -> Iterator[None]:
    """While torch's local agent starts its workers in the block: one context per worker,
    the workers told that the agent restarts them one by one (``per_worker_start``)."""
    with start_processes_replaced(per_worker_start(live_store, generation, watch, spare_store)):
        yield
