"""The agent's side of the process environment: torchrun's ``PET_*`` option defaults that
``elastic-train run`` reads, and what the agent sets for the workers it starts.

worker/env.py is the workers' view, live/environment.py names the variables both sides
share and writes one for the workers (``set_for_workers``); this is the launcher/agent
process's. It touches ``os.environ`` rather than take values as arguments: workers and the
workers' forkserver inherit the agent's environment, so what they need has to be written
into it (before they start, or into the file named by ``WORKER_ENV_FILE`` afterwards); and
``PET_*`` are read from it exactly as torchrun reads them. Free of torch imports (the
launcher imports it first).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping

from elastic_train.live.environment import STOP_NOTE, WORKER_ENV_FILE

# Launcher options that torchrun also reads from PET_<NAME> (torch.distributed.argparse_util:
# ``env`` takes the value, ``check_env`` a flag, set by any non-zero integer).
PET_PREFIX = "PET_"
TORCHRUN_OPTIONS = frozenset({
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "max_restarts", "monitor_interval", "start_method", "event_log_handler", "role",
    "log_dir", "redirects", "tee", "local_ranks_filter", "duplicate_stdout_filters",
    "duplicate_stderr_filters", "node_rank", "master_addr", "master_port", "local_addr",
    "signals_to_handle", "shutdown_timeout", "log_line_prefix_template",
})
TORCHRUN_FLAGS = frozenset({"standalone", "module", "no_python", "run_path",
                            "virtual_local_rank"})


def option_default(dest: str, default: object) -> object:
    """The default of launcher option ``dest``: ``PET_<DEST>`` if torchrun reads it and it
    is set (a flag's: true for a non-zero integer), else ``default``.

    The Kubeflow training operator passes elasticPolicy to torchrun this way
    (PET_NNODES, PET_RDZV_BACKEND, ...), so ``elastic-train run`` in a pod sees the same
    settings torchrun would. An option on the command line still wins.
    """
    value = os.environ.get(f"{PET_PREFIX}{dest.upper()}")
    if value is None:
        return default
    if dest in TORCHRUN_FLAGS:
        return bool(int(value))
    return value if dest in TORCHRUN_OPTIONS else default


def torchrun_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``PET_*`` variables of torchrun's options that are set (sorted): launched as the
    Kubeflow operator launches torchrun, where torchrun's defaults are what the job's
    author expects (launch_options.resolve)."""
    env = os.environ if environ is None else environ
    return sorted(f"{PET_PREFIX}{dest.upper()}" for dest in TORCHRUN_OPTIONS | TORCHRUN_FLAGS
                  if f"{PET_PREFIX}{dest.upper()}" in env)


def launcher_environment_defaults(nproc_per_node: str) -> dict[str, str]:
    """Environment the launcher sets for torch's agent and the workers before they start.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes every rendezvous round create a fresh
    c10d store, so keys of a dead incarnation cannot mislead the next one (docs/stock-torch.md).
    ``OMP_NUM_THREADS=1`` when a node runs more than one worker, as torchrun does;
    ``auto``, ``cpu`` and ``gpu`` counts are left to torchrun, which then starts the
    workers' server itself, after it has set the variable.
    """
    defaults = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if nproc_per_node.isdigit() and int(nproc_per_node) > 1:
        defaults["OMP_NUM_THREADS"] = "1"
    return defaults


def apply_environment_defaults(defaults: Mapping[str, str]) -> None:
    """Set each variable unless the user already set it."""
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def worker_env_file() -> Iterator[str]:
    """A file for ``set_for_workers``, named in ``WORKER_ENV_FILE`` until the block ends.

    Set it before the workers' forkserver starts: forked workers find the file's name in
    the environment they inherit from the server, and ``read_worker_env`` reads it.
    """
    fd, path = tempfile.mkstemp(prefix="elastic-train-worker-env-", suffix=".json")
    os.close(fd)
    os.environ[WORKER_ENV_FILE] = path
    try:
        yield path
    finally:
        os.environ.pop(WORKER_ENV_FILE, None)
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def stop_note_file() -> Iterator[str]:
    """Where this agent writes why it stops its own workers (``STOP_NOTE``), named in the
    environment the workers inherit (set before their forkserver starts) until the block
    ends. The file exists only while such a stop is under way (``agent_stopping``)."""
    directory = tempfile.mkdtemp(prefix="elastic-train-stop-")
    path = os.path.join(directory, "note")
    os.environ[STOP_NOTE] = path
    try:
        yield path
    finally:
        os.environ.pop(STOP_NOTE, None)
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(directory)


@contextlib.contextmanager
def agent_stopping(reason: str) -> Iterator[None]:
    """While the block stops this agent's workers, a SIGTERM they get is the agent's own
    (``reason``), not a preemption: they leave at a step boundary with a checkpoint, say
    why, and never exit as if the job were done. Without ``stop_note_file`` (a plain
    launch) nothing is written."""
    path = os.environ.get(STOP_NOTE)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(reason)
    try:
        yield
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)


LOG_LEVEL = "ELASTIC_TRAIN_LOG_LEVEL"
"""The agent's own log level (``INFO``: every coordination step of a re-formation, whom it
called, who arrived, whom it followed; default ``WARNING``: what a user acts on)."""


def agent_log_level(environ: Mapping[str, str] | None = None) -> str:
    """``ELASTIC_TRAIN_LOG_LEVEL`` (default WARNING), upper-cased."""
    return (os.environ if environ is None else environ).get(LOG_LEVEL, "WARNING").upper()
