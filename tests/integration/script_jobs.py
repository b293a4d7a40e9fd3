"""Users' scripts (user_scripts/) under ``elastic-train run`` or ``torchrun``: one run,
optionally with a SIGKILL of a worker, and its outcome; every wait bounded. Shared by
test_user_scripts.py and scripts/script_exit_soak.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.integration import harness

SCRIPTS = Path(__file__).with_name("user_scripts")
TUTORIAL = SCRIPTS / "tutorial_trainer.py"
PLAIN = SCRIPTS / "plain_env.py"
MODULE = "tests.integration.user_scripts.module_train"
ABORT = "terminate called without an active exception"


@dataclass
class Outcome:
    """How one run ended: its exit status (None: it hung and was killed at the bound)."""

    code: int | None
    seconds: float
    output: str
    killed_pid: int | None = None

    @property
    def hung(self) -> bool:
        return self.code is None

    @property
    def aborted(self) -> bool:
        """A worker died of SIGABRT (the teardown crash), whatever the job then did."""
        return ABORT in self.output or "exitcode: -6" in self.output


def target_argv(shape: str, work: Path, pace: float, exit_code: int = 0) -> list[str]:
    """The script part of the command line for a script shape: ``tutorial`` (epochs, its
    snapshot in ``work``), ``module`` (``-m``), ``plain`` (LOCAL_RANK/RANK/WORLD_SIZE)."""
    if shape == "tutorial":
        return [str(TUTORIAL), "5", "2", "--snapshot_path", str(work / "snapshot.pt"),
                "--pace", str(pace), "--exit-code", str(exit_code)]
    if shape == "module":
        return ["-m", MODULE, "--steps", "60", "--pace", str(pace),
                "--exit-code", str(exit_code)]
    if shape == "plain":
        return [str(PLAIN), "60", str(pace), str(exit_code)]
    raise ValueError(shape)


def launcher_argv(launcher: str, worker_start: str, nproc: int = 2,
                  max_restarts: int = 3) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1"]
    return [sys.executable, "-m", "elastic_train", "run", "--worker-start", worker_start,
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]


def run(shape: str, work: Path, *, worker_start: str = "forkserver", kill_rank: int | None
        = None, launcher: str = "elastic-train", timeout: float = 120.0, exit_code: int = 0,
        max_restarts: int = 3, name: str = "job", env: dict[str, str] | None = None
        ) -> Outcome:
    """Run ``shape`` once in ``work`` (a fresh directory); with ``kill_rank``, SIGKILL that
    worker once the run is under way (its second progress line). A run still going at
    ``timeout`` counts as hung: it is killed and ``code`` is None. ``env``: variables over
    harness.job_env's."""
    work.mkdir(parents=True, exist_ok=True)
    pace = 0.02 if kill_rank is not None else 0.0
    argv = [*launcher_argv(launcher, worker_start, max_restarts=max_restarts),
            *target_argv(shape, work, pace, exit_code)]
    started = time.monotonic()
    job = harness.start(argv, work / name, harness.job_env(env), cwd=work,
                        log_name=name)
    killed = None
    deadline = started + timeout
    if kill_rank is not None:
        killed = _kill_when_running(job, kill_rank, deadline)
    try:
        code: int | None = job.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
        job.stop()
    return Outcome(code, time.monotonic() - started, job.output(), killed)


PROGRESS = re.compile(r"Training snapshot saved|step 10\b")
"""A line each script prints once it is training (a few steps in); for the tutorial, the
line rank 0 prints once its first snapshot is on disk (rank 1's ``Epoch 1`` line can come
before it, and a kill then restarts the script from scratch)."""


def _kill_when_running(job: harness.Job, rank: int, deadline: float) -> int | None:
    """SIGKILL worker ``rank`` once the script is training; its pid (None: never was)."""
    while time.monotonic() < deadline and job.proc.poll() is None:
        if PROGRESS.search(job.output()):
            pid = harness.workers_of(job.proc.pid).get(rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                job.killed.append((rank, pid))
                return pid
        time.sleep(0.01)  # polling the log, bounded by the deadline
    return None
