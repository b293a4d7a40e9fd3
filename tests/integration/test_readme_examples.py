"""The commands of the README and docs/ run as written, and the examples do what they say."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

from elastic_train import cli
from elastic_train.checkpoint.storage import model_digest
from elastic_train.events.log import read_events
from elastic_train.rundir import EVENTS_FILE
from elastic_train.worker.live_world import live_needs_our_agent
from tests.integration import harness, prom

pytestmark = pytest.mark.slow

TIMEOUT = 240
# Every ``$ command`` line of the README and docs/*.md, README first, each once.
readme_commands = harness.readme_commands


def run_readme_command(command: str, cwd: Path, extra: list[str] = (),
                       env: dict[str, str] | None = None) -> harness.Job:
    """Start a documented command in ``cwd`` (the console scripts resolved to this Python)."""
    assert command in readme_commands(), f"not in the README or docs/: {command}"
    argv = shlex.split(command) + list(extra)
    if "elastic_train.train" in argv or argv[:2] == ["elastic-train", "run"]:
        argv = harness.with_metrics_ports(argv)
    if argv[0] == "elastic-train":
        argv = [sys.executable, "-m", "elastic_train", *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    run_dir = cwd / "runs" / "job"
    return harness.start(argv, run_dir, env, cwd=cwd)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A working directory holding the examples, as a user's checkout does."""
    shutil.copytree(harness.REPO / "examples", tmp_path / "examples")
    return tmp_path


def test_readme_names_the_ci_and_demo_commands() -> None:
    commands = readme_commands()
    assert commands[:2] == ["make demo", "make test"]
    assert "make test" in (harness.REPO / ".ci" / "run").read_text()
    makefile = (harness.REPO / "Makefile").read_text()
    assert "$(BIN)/elastic-train run --run-dir runs/demo $(ARGS)" in makefile


def test_demo_command_trains_and_summarises(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # `make demo` runs this command; fewer steps keep the suite fast. A user's shell has no
    # OMP_NUM_THREADS: the launcher sets 1 per worker (2 workers), as torchrun does.
    env = harness.job_env()
    env.pop("OMP_NUM_THREADS")
    job = run_readme_command("elastic-train run --run-dir runs/demo --steps 200 --preset small",
                             workdir, ["--steps", "40", "--checkpoint-every", "20"], env)
    assert job.wait(TIMEOUT) == 0, job.report()
    events = read_events(workdir / "runs" / "demo" / EVENTS_FILE)
    assert [e["threads"] for e in events if e["event"] == "start"] == [1]
    out = job.output()
    assert "run " in out and ": 40/40 steps" in out
    assert "checkpoints       2 written, 0 skipped as corrupt" in out
    assert "restarts survived 0 (0 steps redone)" in out
    listing = subprocess.run(
        [sys.executable, "-m", "elastic_train", "checkpoints", "list", "runs/demo"],
        cwd=workdir, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "MODEL SHA256" in listing and "      40      2" in listing
    assert "elastic-train checkpoints list runs/demo" in readme_commands()
    assert "elastic-train checkpoints verify runs/demo" in readme_commands()
    verify = subprocess.run(
        [sys.executable, "-m", "elastic_train", "checkpoints", "verify", "runs/demo"],
        cwd=workdir, capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The report of that run (in this process: the command's main, in the same directory).
    report = "elastic-train report runs/demo"
    assert report in readme_commands()
    monkeypatch.chdir(workdir)
    assert cli.main(shlex.split(report)[1:]) == 0
    assert capsys.readouterr().out.startswith("run ")
    assert (workdir / "runs" / "demo" / "report.png").stat().st_size > 30_000
    assert "restarts survived 0" in (workdir / "runs" / "demo" / "report.txt").read_text()


def test_alert_rules_test_command() -> None:
    command = next(c for c in readme_commands() if c.startswith("promtool "))
    argv = shlex.split(command)
    done = subprocess.run([prom.tool("promtool"), *argv[1:]], cwd=harness.REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS" in done.stdout + done.stderr, done.stderr


def test_metrics_benchmark_command() -> None:
    command = next(c for c in readme_commands() if "metrics_overhead.py" in c)
    argv = shlex.split(command)
    assert argv[0] == "python"
    done = subprocess.run([sys.executable, *argv[1:], "--steps", "40", "--block", "10"],
                          cwd=harness.REPO, capture_output=True, text=True, timeout=TIMEOUT,
                          env=harness.job_env())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("4 blocks of 10 steps, metrics off and on in turn (world size 1")
    assert re.fullmatch(r"  metrics off +[\d.]+ steps/s \(median of blocks\)", lines[1])
    assert lines[2].startswith("  metrics on ") and lines[3].startswith("  on / off ")
    cost = re.fullmatch(r"  measured cost +[\d.]+ us of metrics per step = ([\d.]+)% of a "
                        r"[\d.]+ ms step", lines[4])
    assert cost and float(cost.group(1)) < 1.0, lines   # microseconds against milliseconds


def test_plain_torchrun_command(workdir: Path) -> None:
    command = next(c for c in readme_commands() if c.startswith("torchrun") and "-m " in c)
    job = run_readme_command(command, workdir, ["--steps", "20", "--preset", "tiny"])
    assert job.wait(TIMEOUT) == 0, job.report()
    assert ": 20/20 steps" in job.output()
    assert (workdir / "runs" / "torchrun" / "checkpoints" / "step-00000020").is_dir()


def test_custom_task_example(workdir: Path) -> None:
    command = next(c for c in readme_commands() if "examples.custom_task:make_task" in c)
    job = run_readme_command(command, workdir)
    assert job.wait(TIMEOUT) == 0, job.report()
    events = harness.Job(job.proc, workdir / "runs" / "custom", job.log_path).events()
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 200
    assert sum(losses[-10:]) / 10 < 0.05 * losses[0]  # it learns


@pytest.mark.extended
def test_handwritten_loop_before_runs(workdir: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "examples/ddp_tutorial.py"]
    job = harness.start(argv, workdir / "runs" / "before", cwd=workdir)
    assert job.wait(TIMEOUT) == 0, job.report()
    assert "epoch 3 loss" in job.output()
    assert (workdir / "runs" / "tutorial-before.pt").is_file()


def tutorial_command() -> list[str]:
    command = next(c for c in readme_commands() if "ddp_tutorial_elastic.py" in c)
    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


@pytest.fixture(scope="module")
def tutorial_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The model digest at the end (step 128) of the tutorial run without interruption."""
    work = tmp_path_factory.mktemp("tutorial-reference")
    shutil.copytree(harness.REPO / "examples", work / "examples")
    argv = tutorial_command()
    job = harness.start([*argv[:-1], "runs/reference"], work / "runs" / "reference", cwd=work)
    assert job.wait(TIMEOUT) == 0, job.report()
    return harness.digest_at(work / "runs" / "reference", 128)


def test_handwritten_loop_made_elastic_resumes_exactly(workdir: Path,
                                                       tutorial_reference: str) -> None:
    argv = tutorial_command()
    assert argv[-1] == "runs/tutorial"
    job = harness.start(argv, workdir / "runs" / "tutorial", cwd=workdir)
    try:
        # The toy steps take milliseconds: the kill lands a few steps after step 30, well
        # before the end (128 steps), mid-epoch (64 steps per epoch).
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 30, timeout=TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    loaded = [e["step"] for e in job.events() if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0] in (20, 40, 60, 80, 100, 120), loaded
    assert harness.digest_at(workdir / "runs" / "tutorial", 128) == tutorial_reference
    # torchrun's agent restarts every worker: said once, with how to silence it
    said = live_needs_our_agent('ElasticSession(..., recovery="restart")')
    assert job.output().count(f"elastic_train: {said}") == 1, job.report()


def test_handwritten_loop_recovers_in_place_under_elastic_train_run(
        workdir: Path, tutorial_reference: str) -> None:
    """The README's ``elastic-train run ... ddp_tutorial_elastic.py``: rank 1 killed, then
    rank 0 (the writer); each time only the dead worker starts again, the survivor keeps
    its process, no checkpoint is loaded, and the weights are torchrun's uninterrupted
    run's, bit for bit."""
    command = next(c for c in readme_commands()
                   if c.startswith("elastic-train run") and "ddp_tutorial_elastic.py" in c)
    argv = [sys.executable, "-m", "elastic_train", *shlex.split(command)[1:]]
    assert argv[-1] == "runs/tutorial-live"
    run_dir = workdir / "runs" / "tutorial-live"
    job = harness.start(argv, run_dir, cwd=workdir)
    kept = []
    try:
        for rank, step in ((1, 30), (0, 70)):
            job.wait_for_event(lambda e, n=step: e["event"] == "step" and e["step"] == n,
                               timeout=TIMEOUT)
            pids = job.worker_pids()
            job.kill_worker(rank)
            job.wait_for_event(lambda e, n=step: e["event"] == "recovery" and e["step"] >= n,
                               timeout=TIMEOUT)
            kept.append(job.worker_pids()[1 - rank] == pids[1 - rank])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True, True], job.report()
    events = job.events()
    assert "checkpoint_loaded" not in [e["event"] for e in events]
    assert [(e["kind"], e["failed_ranks"]) for e in events if e["event"] == "recovery"] == \
        [("live", [1]), ("live", [0])], job.report()
    assert harness.digest_at(run_dir, 128) == tutorial_reference
    assert "epoch 3 loss" in job.output()


def test_handwritten_loop_stops_on_sigterm_and_the_rerun_loses_no_step(
        workdir: Path, tutorial_reference: str) -> None:
    """SIGTERM to one worker: every rank stops at the same step, which rank 0 checkpoints;
    the workers exit 0; the same command resumes there and ends with the reference."""
    argv = tutorial_command()
    run_dir = workdir / "runs" / "tutorial"
    job = harness.start(argv, run_dir, cwd=workdir)
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 30, timeout=TIMEOUT)
        job.kill_worker(1, signal.SIGTERM)
        assert job.wait(60) == 0, job.report()
    finally:
        job.stop()
    events = list(read_events(run_dir / EVENTS_FILE))
    # no worker failed on its way out: torchrun's agent would have restarted them all
    assert [e["restart"] for e in events if e["event"] == "start"] == [0], job.report()
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == 1, job.report()
    stopped = preempted[0]["step"]
    assert 30 <= stopped < 128, job.report()
    assert max(e["step"] for e in events if e["event"] == "step") == stopped, job.report()
    saved = [(e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_saved"]
    assert saved[-1] == (stopped, "preemption"), (saved, job.report())
    assert "end" not in [e["event"] for e in events], job.report()
    out = job.output()
    assert f"stop requested (preemption): stopped at step {stopped} with a checkpoint" in out, \
        job.report()
    assert "Traceback" not in out, job.report()

    rerun = harness.start(argv, run_dir, cwd=workdir)
    assert rerun.wait(TIMEOUT) == 0, rerun.report()
    loaded = [e["step"] for e in read_events(run_dir / EVENTS_FILE)
              if e["event"] == "checkpoint_loaded"]
    assert loaded == [stopped], rerun.report()                  # no step lost
    assert harness.digest_at(run_dir, 128) == tutorial_reference, rerun.report()


def step_loop_command(run_dir: str) -> list[str]:
    command = next(c for c in readme_commands() if "step_loop_elastic.py" in c)
    argv = shlex.split(command)
    assert argv[0] == "torchrun" and argv[-1] == "runs/steps"
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:-1], run_dir]


@pytest.fixture(scope="module")
def step_loop_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The model digest at the end (step 300) of the step-loop example, uninterrupted."""
    work = tmp_path_factory.mktemp("step-loop-reference")
    shutil.copytree(harness.REPO / "examples", work / "examples")
    job = harness.start(step_loop_command("runs/reference"), work / "runs" / "reference",
                        cwd=work)
    assert job.wait(TIMEOUT) == 0, job.report()
    return harness.digest_at(work / "runs" / "reference", 300)


def test_step_loop_resumes_exactly_and_exports_the_final_weights(
        workdir: Path, step_loop_reference: str) -> None:
    run_dir = workdir / "runs" / "steps"
    job = harness.start(step_loop_command("runs/steps"), run_dir, cwd=workdir)
    try:
        # Steps take milliseconds: the kill lands a few steps after step 60, well before
        # the end (300), after the checkpoint of step 50.
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 60, timeout=TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    events = job.events()
    loaded = [e["step"] for e in events if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0] in (50, 100, 150, 200, 250), (loaded, job.report())
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps[-1] == 300 and steps.count(loaded[0] + 1) == 2  # resumed there, 300 in all
    assert harness.digest_at(run_dir, 300) == step_loop_reference
    weights = safetensors.torch.load_file(run_dir / "model.safetensors")
    assert model_digest(weights) == step_loop_reference

    again = harness.start(step_loop_command("runs/steps"), run_dir, cwd=workdir)
    assert again.wait(TIMEOUT) == 0, again.report()
    assert ("elastic_train: runs/steps is finished: its newest checkpoint is at step 300 of "
            "300; nothing to train (raise the total steps to train on, or use a new run "
            "directory to start afresh)") in again.output().splitlines()


def test_sigterm_to_torchrun_stops_the_workers_cleanly_and_torchrun_exits_1(
        workdir: Path) -> None:
    """What the README says of a SIGTERM sent to plain torchrun (Kubernetes' way): the
    workers checkpoint and exit 0, then torch's agent re-raises the signal (exit 1)."""
    run_dir = workdir / "runs" / "steps"
    job = harness.start(step_loop_command("runs/steps"), run_dir, cwd=workdir)
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 60, timeout=TIMEOUT)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(60) == 1, job.report()
    finally:
        job.stop()
    out = job.output()
    (preempted,) = [e for e in job.events() if e["event"] == "preempted"]
    assert f"stop requested (preemption): stopped at step {preempted['step']} with a " \
           "checkpoint" in out
    assert "SignalException: Process" in out and "got signal: 15" in out
    saved = [(e["step"], e["reason"]) for e in job.events() if e["event"] == "checkpoint_saved"]
    assert saved[-1] == (preempted["step"], "preemption")
    assert not (run_dir / "model.safetensors").exists()     # no export after a stop
