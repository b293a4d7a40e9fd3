"""Checkpoint policy in a real (single-process) run: time interval, retention, re-run."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.events.log import read_events
from tests.integration import harness

pytestmark = pytest.mark.slow


def train(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_train.train", "--run-dir", str(run_dir),
         *harness.with_metrics_ports(["--preset", "tiny", "--batch-size", "16", *args], 1)],
        capture_output=True, text=True, timeout=180, env=harness.job_env())


def test_time_interval_and_retention(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = train(run_dir, "--steps", "60", "--checkpoint-every", "off",
                   "--checkpoint-interval", "0.25", "--keep-checkpoints", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = [e for e in read_events(run_dir / "events.jsonl")
             if e["event"] == "checkpoint_saved"]
    periodic = [e for e in saved if e["reason"] == "periodic"]
    assert len(periodic) >= 2, saved
    assert saved[-1]["reason"] == "final" and saved[-1]["step"] == 60
    # Each periodic snapshot began at least the interval after the previous one ended.
    for before, after in itertools.pairwise(saved):
        if after["reason"] == "periodic":
            previous_snapshot_ended = before["snapshot_at"] + before["snapshot_seconds"]
            assert after["snapshot_at"] - previous_snapshot_ended >= 0.25 - 0.01
    steps_on_disk = sorted(int(p.name.split("-")[1])
                           for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps_on_disk == sorted(e["step"] for e in saved)[-2:]
    deleted = [e for e in read_events(run_dir / "events.jsonl")
               if e["event"] == "checkpoint_deleted"]
    assert len(deleted) == len(saved) - 2


def test_rerunning_a_finished_run_trains_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert train(run_dir, "--steps", "20", "--checkpoint-every", "10").returncode == 0
    before = harness.final_digest(run_dir)
    again = train(run_dir, "--steps", "20", "--checkpoint-every", "10")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "(step 20," in again.stdout
    events = list(read_events(run_dir / "events.jsonl"))
    last_start = max(i for i, e in enumerate(events) if e["event"] == "start")
    assert not [e for e in events[last_start:] if e["event"] in ("step", "checkpoint_saved")]
    assert harness.final_digest(run_dir) == before


def _limit_file_size(limit: int):
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_failed_writes_are_reported_and_keep_the_last_good_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert train(run_dir, "--steps", "20", "--checkpoint-every", "10").returncode == 0
    listing_before = harness.checkpoint_listing(run_dir)
    # Resume with a file-size limit below one payload: every save now fails in the OS.
    result = subprocess.run(
        [sys.executable, "-m", "elastic_train.train", "--run-dir", str(run_dir),
         *harness.with_metrics_ports(["--preset", "tiny", "--batch-size", "16", "--steps", "40",
                                      "--checkpoint-every", "10"], 1)],
        capture_output=True, text=True, timeout=180, env=harness.job_env(),
        preexec_fn=_limit_file_size(256 * 1024))
    assert result.returncode == 1
    assert "checkpoint 30 was not written" in result.stderr      # background failure reported
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic_train: error: could not write checkpoint 40 under ")
    assert "File too large" in last and "the previous checkpoints are intact" in last
    events = list(read_events(run_dir / "events.jsonl"))
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [30, 40]
    assert max(e["step"] for e in events if e["event"] == "step") == 40  # training went on
    assert harness.checkpoint_listing(run_dir) == listing_before        # nothing lost
    assert all(row["valid"] for row in listing_before)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
