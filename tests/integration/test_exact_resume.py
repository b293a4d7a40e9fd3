"""Kill -9 a worker of a real 2-worker torchrun job: it finishes with the exact same weights.

The reference is an uninterrupted run with the same seed and world size. Dropout is on, so
the per-step randomness must be derived, not carried; the corpus is small, so the run
crosses several epochs and the sampler must resume mid-epoch and across epoch ends.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from elastic_train.worker.live_world import live_needs_our_agent
from tests.integration import harness

pytestmark = pytest.mark.slow

SAMPLES = 700  # windows of 64 bytes: 10 global batches of 64 per epoch, a tail of 60 dropped
JOB = [
    "--preset", "tiny", "--task-opt", "dropout=0.1",
    "--task-opt", f"corpus_max_bytes={SAMPLES * 64 + 1}",
    "--steps", "40", "--batch-size", "64", "--checkpoint-every", "10",
    "--keep-checkpoints", "10", "--log-every", "10", "--record-samples", "true",
]
TIMEOUT = 180


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    job = harness.torchrun(run_dir, JOB, max_restarts=0)
    assert job.wait(TIMEOUT) == 0, job.report()
    return harness.final_digest(run_dir), run_dir


def effective_samples(run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """{epoch: {step: indices}} of the steps that made the final weights (latest attempt)."""
    latest: dict[tuple[int, int], dict] = {}
    for path in (run_dir / "samples").glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            key = (rec["step"], rec["rank"])
            if key not in latest or rec["restart"] >= latest[key]["restart"]:
                latest[key] = rec
    by_epoch: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for (step, _), rec in sorted(latest.items()):
        by_epoch[rec["epoch"]][step].extend(rec["indices"])
    return by_epoch


def assert_each_sample_once(run_dir: Path, steps: int = 40, batch: int = 64) -> None:
    epochs = effective_samples(run_dir)
    assert sum(len(s) for s in epochs.values()) == steps
    per_epoch = SAMPLES // batch
    for epoch, steps_of in epochs.items():
        seen = [i for indices in steps_of.values() for i in indices]
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeats samples"
        if len(steps_of) == per_epoch:  # a complete epoch: all but the dropped tail
            assert len(seen) == per_epoch * batch
        assert all(0 <= i < SAMPLES for i in seen)


def restarted_from(job: harness.Job) -> list[int]:
    return [e["step"] for e in job.events() if e["event"] == "checkpoint_loaded"]


# The kills of one run, in order: (what, rank to kill, the event after which the kill is
# sent, the checkpoint the resume must use). Each incarnation is struck once, so the
# moments are told apart by the incarnation (restart count) that logged the event.
KILLS = [
    ("in the middle of an interval", 1, lambda e: e["event"] == "step" and e["step"] == 15, 10),
    ("right after a checkpoint", 1,
     lambda e: e["event"] == "checkpoint_saved" and e["step"] == 20, 20),
    ("right before a checkpoint", 1, lambda e: e["event"] == "step" and e["step"] == 29, 20),
    ("the checkpoint writer, rank 0", 0, lambda e: e["event"] == "step" and e["step"] == 35,
     30),
]


def test_sigkill_resume_is_bitwise_exact(reference: tuple[str, Path], tmp_path: Path
                                         ) -> None:
    """Four SIGKILLs at the moments that matter, in one ``elastic-train run`` (workers
    forked from its forkserver): each resume uses the newest checkpoint, and the run ends
    with the reference's weights, bit for bit."""
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*JOB, "--max-restarts", str(len(KILLS)),
                                        "--recovery", "restart"])
    try:
        for restart, (what, rank, when, _) in enumerate(KILLS):
            job.wait_for_event(lambda e, when=when, restart=restart:
                               when(e) and _incarnation_of(job, e) == restart, timeout=TIMEOUT)
            print(f"kill {restart + 1}: rank {rank}, {what}")
            job.kill_worker(rank)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert restarted_from(job) == [resume for *_, resume in KILLS], job.report()
    starts = [e for e in job.events() if e["event"] == "start"]
    assert [s["restart"] for s in starts] == list(range(len(KILLS) + 1))
    ref_digest, ref_dir = reference
    assert harness.final_digest(run_dir) == ref_digest
    # Every checkpoint the two runs share is the same, bit for bit.
    ours = {r["step"]: r["model_digest"] for r in harness.checkpoint_listing(run_dir)}
    theirs = {r["step"]: r["model_digest"] for r in harness.checkpoint_listing(ref_dir)}
    assert ours == theirs
    assert_each_sample_once(run_dir)
    assert f"restarts survived {len(KILLS)}" in job.output()


def _incarnation_of(job: harness.Job, event: dict) -> int:
    """The restart count of the incarnation that logged ``event`` (the newest start before it)."""
    starts = [e for e in job.events() if e["event"] == "start" and e["time"] <= event["time"]]
    return starts[-1]["restart"] if starts else 0


# Extended (make test-extended); the default suite proves it with
# test_sigkill_resume_is_bitwise_exact, and test_plain_torchrun_command in
# test_readme_examples.py.
@pytest.mark.extended
def test_plain_torchrun_survives_a_kill_exactly(reference: tuple[str, Path],
                                                tmp_path: Path) -> None:
    """Under plain torchrun (a fresh interpreter per restart) the resume is exact too; its
    agent restarts every worker, so the job says once that live recovery needs ours."""
    run_dir = tmp_path / "run"
    job = harness.torchrun(run_dir, JOB, max_restarts=3)
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 15, timeout=TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert restarted_from(job) == [10]
    assert harness.final_digest(run_dir) == reference[0]
    assert "restarts survived 1 (5 steps redone)" in job.output()
    assert job.output().count(f"elastic_train: {live_needs_our_agent('--recovery restart')}") == 1


def test_reference_sees_each_sample_once_per_epoch(reference: tuple[str, Path]) -> None:
    assert_each_sample_once(reference[1])
