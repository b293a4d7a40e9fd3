"""``--verify-every`` on real torchrun jobs (gloo, CPU): a bit flipped in one rank's weights
or optimizer state (the drill, ``--inject-bitflip``) is found at the next check, the rank
named by majority (with three replicas) or every rank a suspect (with two); no checkpoint
of the corrupt state is written, the job restarts from the newest one, which is certified,
and went back to a checkpoint holding the state of a run never corrupted, bit for bit."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from elastic_train.observe.report import summary_lines, timeline
from tests.integration import harness

pytestmark = pytest.mark.slow

SAMPLES = 600
JOB = ["--preset", "tiny", "--task-opt", f"corpus_max_bytes={SAMPLES * 64 + 1}",
       "--steps", "30", "--batch-size", "48", "--checkpoint-every", "10",
       "--keep-checkpoints", "10", "--log-every", "10", "--verify-every", "5"]
TIMEOUT = 240


def _run(tmp_path: Path, name: str, nproc: int, extra: list[str]) -> harness.Job:
    job = harness.torchrun(tmp_path / name, [*JOB, *extra], nproc=nproc, max_restarts=2)
    assert job.wait(TIMEOUT) == 0, job.report()
    return job


def _saved_by_first_incarnation(job: harness.Job) -> list[int]:
    """Steps of the checkpoints written before the first restart."""
    saved = []
    for event in job.events():
        if event["event"] == "start" and event.get("restart", 0) > 0:
            break
        if event["event"] == "checkpoint_saved":
            saved.append(event["step"])
    return saved


def test_a_flipped_weight_on_one_of_three_replicas_is_named_and_undone(tmp_path: Path
                                                                       ) -> None:
    # Only its step 10 is compared: 10 steps (within the 20 of warm-up, the learning rate
    # does not depend on the total)
    reference = _run(tmp_path, "reference", 3, ["--steps", "10"])
    job = _run(tmp_path, "drill", 3, ["--inject-bitflip", "1:12"])
    diverged = [e for e in job.events() if e["event"] == "replicas_diverged"]
    assert [(e["step"], e["named"], e["suspects"], e["replicas"]) for e in diverged] == \
        [(15, [1], [1], 3)], diverged
    assert diverged[0]["nodes"] == [socket.gethostname()]
    out = job.output()
    assert "drill: rank 1 flipped bit 12 of element 0 of" in out
    assert ("the replicas' state differs after step 15: rank(s) 1 hold a state that differs "
            "from the majority of their replicas (silent data corruption) on "
            f"{socket.gethostname()}; no checkpoint of this state is written") in out
    # nothing after the flip was checkpointed; the restart took the newest checkpoint
    assert _saved_by_first_incarnation(job) == [10]
    assert [e["step"] for e in job.events() if e["event"] == "checkpoint_loaded"] == [10]
    rows = harness.checkpoint_listing(job.run_dir)
    assert [r["step"] for r in rows] == [30, 20, 10]
    assert all(r["valid"] and r["certified"] for r in rows), rows
    # the certified checkpoint the job went back to holds the state of a run never
    # corrupted, bit for bit
    assert harness.digest_at(job.run_dir, 10) == harness.digest_at(reference.run_dir, 10)
    # Not asserted: the final weights equal the reference's. They did not in the one run
    # of this test (2026-12-01: steps 20 and 30 differ after the restart from step 10, at
    # world 3 under torchrun); test_exact_resume.py proves the bitwise resume at world 2.
    # Open: issue 41's note.


def test_with_two_replicas_a_flipped_optimizer_state_makes_both_suspects(tmp_path: Path
                                                                         ) -> None:
    job = _run(tmp_path, "drill", 2, ["--inject-bitflip", "0:7:optimizer:3:20"])
    diverged = [e for e in job.events() if e["event"] == "replicas_diverged"]
    assert [(e["step"], e["named"], e["suspects"]) for e in diverged] == [(10, [], [0, 1])]
    assert ("the replicas' state differs after step 10: the replicas (ranks 0, 1) disagree "
            "and no majority tells which is right: all are suspects") in job.output()
    # the check before the save at step 10 found it: that checkpoint was never written
    assert _saved_by_first_incarnation(job) == []
    rows = harness.checkpoint_listing(job.run_dir)
    assert [r["step"] for r in rows] == [30, 20, 10]
    assert all(r["certified"] for r in rows), rows
    lines = summary_lines(timeline(job.events()))  # elastic-train report's summary
    assert [line for line in lines if "CORRUPTION" in line] == [
        "  CORRUPTION        the replicas' state differed after step 10: no majority: "
        f"ranks [0, 1] suspect, on {socket.gethostname()}"], lines


@pytest.mark.xfail(strict=False, reason="under elastic-train run the live agent first starts "
                   "each failed worker again into the running world (spending its live "
                   "restarts) before it restarts the job from the checkpoint: the workers "
                   "must tell their agent that the world restarts (not built yet)")
def test_the_documented_drill_under_elastic_train_run_names_rank_1_and_the_job_finishes(
        tmp_path: Path) -> None:
    """docs/wrong-or-slow-nodes.md's command, as a user runs it (live recovery on: every
    worker fails the corrupt step together and the agent restarts them all from the
    newest checkpoint), with fewer steps."""
    command = harness.readme_command("--inject-bitflip")
    argv, env = harness.readme_argv(command, job=["--steps", "30", "--checkpoint-every", "10",
                                                  "--batch-size", "48", "--task-opt",
                                                  f"corpus_max_bytes={SAMPLES * 64 + 1}"])
    run_dir = tmp_path / "runs" / "drill"
    argv = harness.with_metrics_ports([*argv, "--run-dir", str(run_dir)], 3)
    job = harness.start(argv, run_dir, harness.job_env(env), cwd=tmp_path)
    assert job.wait(TIMEOUT) == 0, job.report()
    diverged = [e for e in job.events() if e["event"] == "replicas_diverged"]
    assert [(e["step"], e["named"]) for e in diverged] == [(15, [1])], diverged
    assert job.output().count("the replicas' state differs after step 15") == 1
    assert _saved_by_first_incarnation(job) == [10]
    rows = harness.checkpoint_listing(run_dir)
    assert rows[0]["step"] == 30 and all(r["certified"] for r in rows), rows
