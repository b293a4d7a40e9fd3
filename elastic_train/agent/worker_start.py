"""Where ``elastic-train run``'s workers come from: a forkserver that imported torch once.

Every worker, restarted ones included, is forked from a server process that has already
imported torch and the trainer, so a restart skips the imports (seconds). The launcher
starts that server before it imports torch itself, so the two imports run side by side
instead of one after the other.

A forked worker inherits the server's environment, fixed when the server started: what the
workers need from the launcher's environment is set before it starts
(``prepare_environment``); values the agent learns later reach them through the file named
by ``WORKER_ENV_FILE`` (``live.environment.set_for_workers``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing import forkserver

from elastic_train.agent.environment import (
    apply_environment_defaults,
    launcher_environment_defaults,
    stop_note_file,
    worker_env_file,
)

# Imported once by the forkserver; every (re)started worker is forked with them loaded.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "elastic_train.worker.train", "elastic_train.tasks.gpt",
           "elastic_train.worker.script_worker"]


def prepare_environment(nproc_per_node: str) -> None:
    """Set what the workers' environment needs before any worker process exists
    (``agent_env.launcher_environment_defaults``), early enough for the forkserver to
    inherit it."""
    apply_environment_defaults(launcher_environment_defaults(nproc_per_node))


@contextlib.contextmanager
def worker_processes(method: str, nproc_per_node: str) -> Iterator[None]:
    """The workers' environment, and with ``method="forkserver"`` their server, started now.

    The server is stopped on the way out, at once: after a failed pre-flight it may still
    be importing torch, seconds of CPU before it would notice that its launcher is gone.
    """
    prepare_environment(nproc_per_node)
    if method != "forkserver":
        with stop_note_file():
            yield
        return
    with worker_env_file(), stop_note_file():
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        if nproc_per_node.isdigit():  # else torchrun sets OMP_NUM_THREADS, then starts it
            forkserver.ensure_running()
        try:
            yield
        finally:
            stop_worker_server()


def stop_worker_server() -> None:
    """Kill the forkserver and let multiprocessing reap it and forget it (private API of
    CPython's ``multiprocessing.forkserver``, stable since 3.4; skipped if it changes)."""
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if not pid or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()


@contextlib.contextmanager
def workers_released_on_close() -> Iterator[None]:
    """Let forked workers that finished exit when the agent stops them.

    torch's function-entrypoint workers, after returning, wait for an event that the agent
    sets only when it collects every return value. When the agent instead stops them (its
    SIGTERM, or a restart to admit a node), a worker that stops gracefully on SIGTERM
    (checkpoint, return) waits for that event until the agent's shutdown timeout (30 s)
    runs out and it is SIGKILLed. Setting the event at the start of close() lets it exit
    at once; workers still running are unaffected (they wait for it only after returning).
    """
    # Imported here: the seam imports torch, and this module is imported before the
    # forkserver starts, whose own import of torch must not wait for the launcher's.
    from elastic_train.agent.torch_seams import finished_workers_released_on_close

    with finished_workers_released_on_close():
        yield
