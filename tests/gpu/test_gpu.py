"""The CUDA paths on a real GPU: run where CUDA is (scripts/gpu-check.sh), skipped elsewhere.

One GPU allows one NCCL rank per process group, so the NCCL runs have one worker; two
workers share the GPU with gloo on CUDA tensors. Every run uses deterministic kernels
(``--deterministic``) and dropout, so a resumed or recovered run must end with the
uninterrupted run's weights, bit for bit.

``ELASTIC_TRAIN_GPU_DRY_RUN=1`` on a machine without CUDA runs the same tests on the CPU
(gloo, no device checks): it proves the tests themselves before a GPU's time is spent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from elastic_train.events.log import read_events
from elastic_train.rundir import EVENTS_FILE
from tests import procfs
from tests.gpu.cuda_task import HANG_FLAG
from tests.integration import harness

CUDA = torch.cuda.is_available()
DRY_RUN = not CUDA and os.environ.get("ELASTIC_TRAIN_GPU_DRY_RUN") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not CUDA and not DRY_RUN,
                       reason="needs a CUDA device: run scripts/gpu-check.sh on a GPU machine"),
]

# On the GPU steps take milliseconds: enough of them that a kill lands mid-run. The dry
# run on 2 CPU cores trains the tiny model for fewer steps.
STEPS, KILL_AT, EVERY, PRESET, BATCH = (300, 100, 50, "small", 64) if CUDA else \
    (60, 25, 10, "tiny", 16)
TIMEOUT = 300
JOB = ["--task", "tests.gpu.cuda_task:make_task", "--task-opt", f"preset={PRESET}",
       "--task-opt", "dropout=0.1", "--task-opt", f"require_cuda={int(CUDA)}",
       "--batch-size", str(BATCH), "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
       "--deterministic", "true", "--log-every", str(EVERY)]
ONE_BACKEND = "nccl" if CUDA else "gloo"
NCCL_1 = [*JOB, "--nproc-per-node", "1", "--backend", ONE_BACKEND]
GLOO_2 = [*JOB, "--nproc-per-node", "2", "--backend", "gloo"]


def _run_to_end(run_dir: Path, args: list[str]) -> harness.Job:
    job = harness.elastic_run(run_dir, args)
    try:
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    return job


@pytest.fixture(scope="module")
def nccl_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    run_dir = tmp_path_factory.mktemp("nccl-reference") / "run"
    _run_to_end(run_dir, [*NCCL_1, "--max-restarts", "0"])
    return harness.final_digest(run_dir)


@pytest.fixture(scope="module")
def gloo_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    run_dir = tmp_path_factory.mktemp("gloo-reference") / "run"
    _run_to_end(run_dir, [*GLOO_2, "--max-restarts", "0"])
    return harness.final_digest(run_dir)


def _driver_files(pid: int) -> list[str]:
    """The NVIDIA device files the process holds open. CUDA's driver opens them when it
    initialises (``cuInit``), which is what must not happen before a fork; merely loading
    ``libcuda.so`` does not (torch 2.11's import maps it in the forkserver, seen on the
    H100), so the library's presence in /proc/PID/maps proves nothing."""
    fd_dir = Path(f"/proc/{pid}/fd")
    paths = []
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):  # closed since it was listed
            paths.append(os.readlink(fd))
    return sorted(p for p in paths if p.startswith("/dev/nvidia"))


def _has_cuda_context(pid: int) -> bool:
    """Whether CUDA's driver was initialised in the process; on a dry run, whether the
    process is alive."""
    return bool(_driver_files(pid)) if CUDA else Path(f"/proc/{pid}").exists()


def _parent(pid: int) -> int | None:
    return procfs.parent(pid)


def _step_event(step: int):  # type: ignore[no-untyped-def]
    return lambda e: e["event"] == "step" and e["step"] == step


def _killed_at(job: harness.Job, step: int) -> harness.Job:
    """``job`` with worker 0 SIGKILLed once it logged ``step``, run to its end (which must
    be a success: the restart resumed from a checkpoint)."""
    try:
        job.wait_for_event(_step_event(step), timeout=TIMEOUT)
        job.kill_worker(0)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    return job


def test_nccl_world_of_one_resumes_bitwise_after_sigkill(nccl_reference: str,
                                                         tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = _killed_at(harness.elastic_run(run_dir, [*NCCL_1, "--max-restarts", "2"]), KILL_AT)
    events = job.events()
    starts = [e for e in events if e["event"] == "start"]
    assert [(e["restart"], e["backend"]) for e in starts] == [(0, ONE_BACKEND), (1, ONE_BACKEND)]
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded["step"] >= EVERY
    # Periodic checkpoints overlapped the next step: the side stream's copy was in flight
    # (copy_seconds is written only then), and training waited less than the copy took.
    periodic = [e for e in events if e["event"] == "checkpoint_saved" and e["reason"] == "periodic"]
    assert periodic and all("copy_seconds" in e for e in periodic), periodic
    print("periodic saves (s): " + "; ".join(
        f"step {e['step']}: snapshot {e['snapshot_seconds']}, copy enqueued "
        f"{e['copy_seconds']}, training waited {e['copy_wait_seconds']}" for e in periodic))
    # Restored onto the GPU: every step after the restore checked the devices (cuda_task).
    assert harness.final_digest(run_dir) == nccl_reference


def test_gloo_on_cuda_two_workers_recover_live_and_the_forkserver_has_no_cuda(
        gloo_reference: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, GLOO_2)
    try:
        job.wait_for_event(_step_event(KILL_AT), timeout=TIMEOUT)
        pids = job.worker_pids()
        server = _parent(pids[0])
        assert _parent(pids[1]) == server != job.proc.pid, "workers not forked from a server"
        assert not CUDA or not _has_cuda_context(server), \
            f"CUDA initialised in the forkserver: it holds {_driver_files(server)} open"
        assert all(_has_cuda_context(pid) for pid in pids.values())
        killed = job.kill_worker(1)
        recovery = job.wait_for_event(lambda e: e["event"] == "recovery", timeout=TIMEOUT)
        after = job.worker_pids()
        assert after[0] == pids[0] and after[1] not in (killed, pids[0])  # survivor kept
        assert _parent(after[1]) == server and _has_cuda_context(after[1])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert recovery["kind"] == "live" and recovery["failed_ranks"] == [1], recovery
    assert recovery["steps_redone"] <= 1
    print(f"live recovery on the GPU (gloo, CUDA tensors): {recovery['seconds']:.3f}s, "
          f"{recovery['bytes']} bytes sent")
    assert harness.final_digest(run_dir) == gloo_reference


def test_a_hung_cuda_kernel_is_found_by_the_step_timeout_and_the_job_resumes(
        nccl_reference: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*NCCL_1, "--max-restarts", "2", "--step-timeout", "5",
            "--task-opt", "hang_rank=0", "--task-opt", f"hang_after={KILL_AT}"]
    job = harness.elastic_run(run_dir, args)
    try:
        job.wait_for_event(_step_event(KILL_AT - 1), timeout=TIMEOUT)
        began = time.monotonic()
        hang = job.wait_for_event(lambda e: e["event"] == "hang", timeout=60)
        detected_after = time.monotonic() - began
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert (run_dir / HANG_FLAG).exists()
    assert hang["detected_by"] == 0 and hang["stalled_seconds"] >= 5, hang
    assert detected_after < 5 + 10, detected_after
    assert "no step completed for" in job.output()
    starts = [e for e in job.events() if e["event"] == "start"]
    assert [e["restart"] for e in starts] == [0, 1]
    assert harness.final_digest(run_dir) == nccl_reference


def test_sigterm_on_the_gpu_stops_within_the_budget_and_the_rerun_is_exact(
        nccl_reference: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*NCCL_1, "--max-restarts", "0"])
    try:
        job.wait_for_event(_step_event(KILL_AT), timeout=TIMEOUT)
        signalled = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        job.wait(60)
        stopped_in = time.monotonic() - signalled
    finally:
        job.stop()
    assert stopped_in < 15, f"the job took {stopped_in:.1f}s to stop"
    events = list(read_events(run_dir / EVENTS_FILE))
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    saved = [(e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_saved"]
    assert saved[-1] == (preempted["step"], "preemption"), saved
    _run_to_end(run_dir, [*NCCL_1, "--max-restarts", "0"])
    assert harness.final_digest(run_dir) == nccl_reference


def _session_job(run_dir: Path, max_restarts: int) -> harness.Job:
    script = Path(__file__).with_name("session_cuda_loop.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script), str(run_dir)]
    return harness.start(argv, run_dir)


def test_elastic_session_with_a_cuda_model_resumes_bitwise(tmp_path: Path) -> None:
    reference = _session_job(tmp_path / "reference", 0)
    try:
        assert reference.wait(TIMEOUT) == 0, reference.report()
    finally:
        reference.stop()
    run_dir = tmp_path / "run"
    job = _killed_at(_session_job(run_dir, 2), 120)  # of 200 steps, checkpoints every 25
    loaded = [e["step"] for e in job.events() if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0] >= 25, job.report()
    assert harness.final_digest(run_dir) == harness.final_digest(tmp_path / "reference")


def test_fsdp_on_the_gpu_writes_sharded_checkpoints_and_resumes_bitwise(
        tmp_path: Path) -> None:
    """``--parallelism fsdp`` (FSDP2's fully_shard on a CUDA mesh, NCCL; one rank per GPU):
    a SIGKILLed worker restarts from its sharded checkpoint, restored onto the GPU, and
    ends with the weights of the run never killed, bit for bit."""
    fsdp = [*NCCL_1, "--parallelism", "fsdp"]
    reference = tmp_path / "reference"
    _run_to_end(reference, [*fsdp, "--max-restarts", "0"])
    run_dir = tmp_path / "run"
    job = _killed_at(harness.elastic_run(run_dir, [*fsdp, "--max-restarts", "2"]), KILL_AT)
    (loaded,) = [e for e in job.events() if e["event"] == "checkpoint_loaded"]
    assert loaded["step"] >= EVERY
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in final.iterdir()) == [
        "common.pt", "manifest.json", "shard-00000.safetensors"]
    saved = [e for e in job.events() if e["event"] == "checkpoint_saved"]
    print("fsdp on the GPU, sharded saves (s): " + "; ".join(
        f"step {e['step']}: snapshot {e['snapshot_seconds']}, persist {e['persist_seconds']}"
        for e in saved))
    assert harness.final_digest(run_dir) == harness.final_digest(reference)
