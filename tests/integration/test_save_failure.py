"""A checkpoint write that fails in the OS, mid-run, under each ``--on-save-failure`` policy.

The disk "fills up" for rank 0 only and only while the test says so: its file-size limit
(RLIMIT_FSIZE, set on the live worker with prlimit) drops below one checkpoint, so the
write of the payload fails with EFBIG (Python ignores SIGXFSZ) — a real OS error from a
real write, like ENOSPC. ``continue`` reports it and goes on; ``stop`` stops every rank at
the next step and fails the job with one line. Either way the checkpoints written before
are untouched, and no ``step-N`` of the failed write appears.
"""

from __future__ import annotations

import hashlib
import re
import resource
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import harness

pytestmark = pytest.mark.slow

STEPS, EVERY = 60, 5
JOB = ["--task", "tests.integration.paced_task:make_task", "--preset", "tiny",
       "--task-opt", "pace=0.05", "--batch-size", "32", "--steps", str(STEPS),
       "--checkpoint-every", str(EVERY), "--keep-checkpoints", "20", "--log-every", "20"]
FULL = 256 * 1024  # bytes: below a tiny checkpoint (~1.5 MB), above the logs rank 0 writes
TIMEOUT = 180


def set_file_size_limit(pid: int, limit: int) -> None:
    """The soft RLIMIT_FSIZE of a live process (the hard limit stays: it can be raised back)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))


def step_dirs(run_dir: Path) -> dict[str, dict[str, str]]:
    """{step dir: {file: sha256}} of every checkpoint directory (valid or not)."""
    return {d.name: {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                     for f in sorted(d.iterdir())}
            for d in sorted((run_dir / "checkpoints").glob("step-*"))}


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def fill_the_disk_after(job: harness.Job, step: int
                        ) -> tuple[int, dict[str, dict[str, str]], dict[str, Any]]:
    """Once checkpoint ``step`` is saved, limit rank 0 and wait for a write to fail.

    Returns rank 0's pid, the checkpoints on disk when that write failed (checked to be
    those from before the limit, unchanged), and the ``checkpoint_failed`` event.
    """
    job.wait_for_event(lambda e: e["event"] == "checkpoint_saved" and e["step"] == step,
                       TIMEOUT)
    pid = job.worker_pids()[0]
    set_file_size_limit(pid, FULL)
    before = step_dirs(job.run_dir)  # training went on meanwhile: maybe one more checkpoint
    failed = job.wait_for_event(lambda e: e["event"] == "checkpoint_failed", TIMEOUT)
    at_failure = step_dirs(job.run_dir)
    assert {name: at_failure.get(name) for name in before} == before
    return pid, at_failure, failed


def test_continue_reports_the_failure_and_training_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*JOB, "--on-save-failure", "continue",
                                        "--max-restarts", "0"])
    try:
        pid, before, failed = fill_the_disk_after(job, 10)
        set_file_size_limit(pid, resource.RLIM_INFINITY)  # space again
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    events = job.events()
    failed_steps = [e["step"] for e in of(events, "checkpoint_failed")]
    saved_steps = [e["step"] for e in of(events, "checkpoint_saved")]
    assert failed["step"] == failed_steps[0] > 10 and "File too large" in failed["error"]
    assert not set(failed_steps) & set(saved_steps)
    # Every due checkpoint was tried: the failed ones, then the next ones again.
    assert sorted(failed_steps + saved_steps) == list(range(EVERY, STEPS + 1, EVERY))
    assert saved_steps[-1] == STEPS and max(e["step"] for e in of(events, "step")) == STEPS
    after = step_dirs(run_dir)
    assert {name: after[name] for name in before} == before   # byte-identical
    assert sorted(after) == [f"step-{s:08d}" for s in sorted(saved_steps)]
    assert all(row["valid"] for row in harness.checkpoint_listing(run_dir))
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    out = job.output()
    step = failed_steps[0]
    assert (f"checkpoint {step} was not written: could not write checkpoint {step} under "
            f"{run_dir / 'checkpoints'} (File too large): free space or fix permissions; the "
            "previous checkpoints are intact; training goes on and the next checkpoint is "
            "tried when due (--on-save-failure continue)") in out


def test_stop_stops_every_rank_and_fails_the_job_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*JOB, "--on-save-failure", "stop"]
    # One restart allowed: the restarted workers (not limited) must not train on.
    job = harness.elastic_run(run_dir, [*args, "--max-restarts", "1"])
    try:
        _, before, failed = fill_the_disk_after(job, 10)
        code = job.wait(TIMEOUT)
    finally:
        job.stop()
    assert code == 1, job.report()
    events = job.events()
    assert of(events, "checkpoint_failed") == [failed]
    stopped = of(events, "stopped")
    assert len(stopped) == 2                  # the stop, and the restart that refused to train
    assert {(e["failed_step"], e["last_good_step"]) for e in stopped} == \
        {(failed["step"], failed["step"] - EVERY)}
    stop_step = stopped[0]["step"]
    # Every rank stopped at one step boundary, before the next checkpoint was due.
    assert failed["step"] < stop_step < failed["step"] + EVERY
    assert max(e["step"] for e in of(events, "step")) == stop_step
    assert step_dirs(run_dir) == before       # the last good checkpoint, byte for byte
    assert max(before) == f"step-{failed['step'] - EVERY:08d}"
    last_good = failed["step"] - EVERY
    listing = harness.checkpoint_listing(run_dir)
    assert listing[0]["step"] == last_good and all(row["valid"] for row in listing)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    line = (f"stopped at step {stop_step}: checkpoint {failed['step']} could not be written "
            f"under {run_dir / 'checkpoints'} (File too large) and --on-save-failure is stop: "
            "free space or fix permissions, then rerun the same command (it resumes from "
            f"checkpoint {last_good}, which is intact)")
    out = job.output().splitlines()
    # The restarted workers all refuse with rank 0's message; the agent names whichever
    # failed first.
    final = [x for x in out if x.startswith("elastic-train: ")]
    assert len(final) == 1 and re.fullmatch(
        r"elastic-train: job failed: rank [01] failed: CheckpointStopError: not restarting: "
        + re.escape(f"{line} (run dir {run_dir})"), final[0]), final
    assert f"elastic_train: error: {line}" in out   # rank 0's, once
    assert sum("elastic_train: error: " in x for x in out) == 2   # and the refused restart's

    # With space again, the same command resumes from the last good checkpoint and finishes.
    rerun = harness.elastic_run(run_dir, [*args, "--steps", str(last_good + EVERY)])
    assert rerun.wait(TIMEOUT) == 0, rerun.report()
    loaded = of(rerun.events(), "checkpoint_loaded")
    assert loaded[-1]["step"] == last_good


SESSION_SCRIPT = harness.REPO / "tests" / "integration" / "session_disk_full.py"


def session_job(run_dir: Path, *args: str, max_restarts: int = 0) -> harness.Job:
    """The hand-written loop of session_disk_full.py under plain torchrun, 2 workers."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(SESSION_SCRIPT),
            str(run_dir), *args]
    return harness.start(argv, run_dir)


# Extended (make test-extended); the default suite proves it with
# test_stop_stops_every_rank_and_fails_the_job_with_one_line (the same stop, the built-in loop).
@pytest.mark.extended
def test_a_session_loop_stops_every_rank_on_a_failed_save(tmp_path: Path) -> None:
    """The same stop through ElasticSession: both ranks raise the one line at one step, the
    agent's restart refuses to train on, and a rerun resumes from the last good checkpoint."""
    run_dir = tmp_path / "run"
    job = session_job(run_dir, "--fill", max_restarts=1)
    try:
        code = job.wait(TIMEOUT)
    finally:
        job.stop()
    assert code == 1, job.report()
    events = job.events()
    (failed,) = of(events, "checkpoint_failed")
    assert failed["step"] == 15 and "File too large" in failed["error"]
    stopped = of(events, "stopped")
    assert len(stopped) == 2                  # the stop, and the restart that refused to train
    assert {(e["step"], e["failed_step"], e["last_good_step"]) for e in stopped} == {(16, 15, 10)}
    assert max(e["step"] for e in of(events, "step")) == 16
    assert [e["step"] for e in of(events, "checkpoint_saved")] == [5, 10]
    assert sorted(step_dirs(run_dir)) == ["step-00000005", "step-00000010"]
    assert all(row["valid"] for row in harness.checkpoint_listing(run_dir))
    line = (f"stopped at step 16: checkpoint 15 could not be written under "
            f"{run_dir / 'checkpoints'} (File too large) and on_save_failure is stop: free "
            "space or fix permissions, then rerun the same command (it resumes from "
            "checkpoint 10, which is intact)")
    out = job.output().splitlines()
    # Both ranks of the stop raise rank 0's line; both restarted ranks refuse with it.
    assert sum(x.endswith(f"CheckpointStopError: {line}") for x in out) == 2, job.report()
    assert sum(x.endswith(f"CheckpointStopError: not restarting: {line}")
               for x in out) == 2, job.report()

    rerun = session_job(run_dir)
    assert rerun.wait(TIMEOUT) == 0, rerun.report()
    events = rerun.events()
    assert of(events, "checkpoint_loaded")[-1]["step"] == 10
    assert max(e["step"] for e in of(events, "step")) == 40
    assert of(events, "end")[-1]["step"] == 40
