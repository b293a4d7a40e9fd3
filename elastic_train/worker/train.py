"""The worker entrypoint torchrun runs: ``torchrun ... -m elastic_train.train [job options]``.

Also runs without torchrun, as a world of one: ``python -m elastic_train.train ...``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train.config_options import parse_job_args
from elastic_train.errors import ElasticTrainError, NodeStoppedError
from elastic_train.live.spare import is_spare, take_place, wait_for_place
from elastic_train.observe.metrics_server import WorkerEndpoint, serve_worker_metrics
from elastic_train.process_exit import exit_process
from elastic_train.tasks.base import Task, TaskContext
from elastic_train.tasks.loader import load_task
from elastic_train.worker.aborts import abandoned_groups
from elastic_train.worker.bootstrap import join_world, place_worker
from elastic_train.worker.distributed import destroy_group
from elastic_train.worker.env import WorkerEnv, read_worker_env
from elastic_train.worker.process_name import name_process
from elastic_train.worker.trainer import Built, Trainer, build_task, warm_up

IMPORTED = time.time()  # start-up timeline: imports done


@dataclass
class SpareBuilt(Built):
    """What a hot spare built before it took a place, with the task it built from."""

    task: Task | None = None


def _setup_logging(rank: int) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    _prefix_rank(handler, rank)
    logger = logging.getLogger("elastic_train")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def _prefix_rank(handler: logging.Handler, rank: int) -> None:
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def _follow_rank(log_handler: logging.Handler, endpoint: WorkerEndpoint | None
                 ) -> Callable[[WorkerEnv], None]:
    """What follows this worker to a new rank (runtime.on_moved): its process name, its log
    lines' prefix and its metrics' rank label."""
    def moved(env: WorkerEnv) -> None:
        name_process(env.rank)
        _prefix_rank(log_handler, env.rank)
        if endpoint is not None:
            endpoint.metrics.moved(env)
    return moved


def _record_for_agent(exc: BaseException) -> None:
    """Leave the error where torch's agent reports it (TORCHELASTIC_ERROR_FILE)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # reporting must never hide the original error
        pass


@record
def main(argv: Sequence[str] | None = None, imported_at: float | None = None) -> int:
    """Run one worker; return its exit code (0 done, non-zero failed).

    Our own errors become one line and an exit code; anything unexpected is recorded by
    torchelastic's ``@record`` so that the agent (and ``elastic-train run``) can name it.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    built: SpareBuilt | None = None
    if is_spare():
        built = _build_as_spare(args)
        if built is None:  # its agent ended, or it could not build: nothing to do
            return 0
        imported_at = time.time()  # its start-up timeline begins with its place
    env = read_worker_env()
    endpoint: WorkerEndpoint | None = None
    trainer: Trainer | None = None
    linger = 0.0
    try:
        config = parse_job_args(args)
        d = config.distributed
        place = place_worker(env, config.run_dir, recovery=config.distributed.recovery,
                             backend=d.backend,
                             timeout_seconds=d.timeout_seconds,
                             restart_spelling="--recovery restart",
                             deterministic=config.train.deterministic, own_process=True,
                             storage=config.storage)
        env, live = place.env, place.live
        log_handler = _setup_logging(env.rank)
        endpoint = serve_worker_metrics(config, env)
        task = built.task if built is not None else load_task(
            config.train.task, TaskContext(config.train.task_options, config.train.seed,
                                           config.run_dir))
        group_began = time.time()
        group = join_world(place, d.backend, d.timeout_seconds)
        marks = {"imported": imported_at or IMPORTED, "group_began": group_began,
                 "group_ready": time.time()}
        observers = [endpoint.metrics.observe] if endpoint is not None else []
        trainer = Trainer(config, env, task, group, marks=marks, observers=observers, live=live,
                          built=built)
        trainer.runtime.on_moved.append(_follow_rank(log_handler, endpoint))
        trainer.run()
        if trainer.state.step >= config.train.steps:   # not after a preemption: no time
            linger = config.metrics.linger_seconds
    except NodeStoppedError as exc:  # not an error: the world re-forms without that node
        if env.local_rank == 0:
            print(f"elastic_train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except ElasticTrainError as exc:
        rank = trainer.runtime.env.rank if trainer is not None else env.rank  # rank now
        if rank == 0 or not getattr(exc, "reported_by_rank0", False):  # one line per job
            print(f"elastic_train: error: {exc}", file=sys.stderr, flush=True)
        _record_for_agent(exc)
        return exc.exit_code
    finally:
        destroy_group()
        if endpoint is not None:
            endpoint.close(linger)  # after a finished run: one last scrape of final values
    return 0


def _build_as_spare(args: list[str]) -> SpareBuilt | None:
    """A hot spare (live/spare.py): load the task and build its model and dataset, then wait
    for the place of a failed worker and take it. None when its agent ended first, or when
    it cannot build (the replacement its agent forks instead reports why)."""
    name_process(None)
    env = read_worker_env()
    try:
        config = parse_job_args(args)
        task = load_task(config.train.task, TaskContext(config.train.task_options,
                                                        config.train.seed, config.run_dir))
        built = build_task(task, config.train.seed)
    except Exception:  # a spare says nothing: the replacement forked instead reports it
        return None
    if not torch.cuda.is_available():  # on a GPU node it would take CPU from the workers
        with contextlib.suppress(Exception):  # an optimisation only
            warm_up(task, built, config.train.batch_size // max(1, env.world_size),
                    config.train.lr)
    place = wait_for_place(env.live_store) if env.live_store else None
    if place is None:
        return None
    take_place(place)
    return SpareBuilt(built.model, built.dataset, task)


def run_worker(*argv: str) -> None:
    """Function entrypoint for torch's elastic launcher (``elastic-train run``'s workers).

    A failure must be an exit status, not a return value, for the agent to restart.
    """
    code = main(list(argv), imported_at=time.time())  # forked with everything imported
    if code:
        sys.exit(code)


def _exit(code: int) -> None:
    """Exit; a process that dropped a group with stuck work (live recovery) skips the
    interpreter's teardown, whose destructors would wait for that work or abort."""
    if abandoned_groups():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    exit_process(code)


def run_as_main() -> None:
    """``python -m elastic_train.train`` (and this module run as a script): main, then exit."""
    _exit(main())


if __name__ == "__main__":
    run_as_main()
