"""A rank that stops (SIGSTOP) does not hang the job: the watchdog names it, the job restarts."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from elastic_train.events.log import read_events
from tests.integration import harness

pytestmark = pytest.mark.slow


def test_a_stopped_rank_is_named_and_the_job_recovers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = harness.torchrun(
        run_dir, ["--preset", "tiny", "--batch-size", "64", "--steps", "30",
                  "--checkpoint-every", "10", "--step-timeout", "4", "--log-every", "10"],
        max_restarts=2, rdzv=["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                              "--shutdown-timeout=2"])
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 12, timeout=180)
        stopped_at = time.monotonic()
        stopped_pid = job.kill_worker(1, signal.SIGSTOP)
        hang = job.wait_for_event(lambda e: e["event"] == "hang", timeout=60)
        detected_after = time.monotonic() - stopped_at
        assert job.wait(180) == 0, job.report()
    finally:
        job.stop()
    assert hang["detected_by"] == 0 and hang["stuck_rank"] == 1, hang
    assert hang["killed_pid"] == stopped_pid
    assert hang["stalled_seconds"] >= 4
    assert detected_after < 4 + 10                        # within the timeout and a beat or two
    out = job.output()
    assert "rank 0: no step completed for" in out and "rank 1 last heard" in out
    events = list(read_events(run_dir / "events.jsonl"))
    starts = [e for e in events if e["event"] == "start"]
    assert [e["restart"] for e in starts] == [0, 1]
    assert "Unable to shutdown process" not in out          # no 30 s wait on a stopped worker
    assert max(e["step"] for e in events if e["event"] == "step") == 30
    with pytest.raises(ProcessLookupError):  # the stopped process was killed, not left behind
        import os

        os.kill(stopped_pid, 0)
