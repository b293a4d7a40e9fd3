"""Preemption: SIGTERM stops every rank at the same step with a checkpoint; nothing is lost.

After the stop, rerunning the same command resumes from the preemption checkpoint and ends
with the weights of a run that was never stopped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_train.events.log import read_events
from tests.integration import harness
from tests.integration.harness import TINY_DROPOUT, TINY_DROPOUT_STEPS

pytestmark = pytest.mark.slow

# No periodic checkpoint before the end: the preemption's is the only one.
JOB = [*TINY_DROPOUT, "--checkpoint-every", "50", "--log-every", "10"]
TIMEOUT = 180


@pytest.fixture
def reference_digest(tiny_dropout_reference: dict[int, str]) -> str:
    return tiny_dropout_reference[TINY_DROPOUT_STEPS]


# The agent's SIGTERM reaches the workers as the worker's own does (the agent passes it on):
# the default suite sends it to a worker, make test-extended to the agent as well.
@pytest.mark.parametrize("target", [pytest.param("agent", marks=pytest.mark.extended),
                                    "worker"])
def test_sigterm_stops_cleanly_and_the_rerun_loses_no_step(target: str, reference_digest: str,
                                                           tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    if target == "agent":  # as Kubernetes does: SIGTERM to the container's main process
        job = harness.elastic_run(run_dir, [*JOB, "--max-restarts", "0"])
    else:
        job = harness.torchrun(run_dir, JOB, max_restarts=0)
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 12, timeout=TIMEOUT)
        signalled = time.monotonic()
        if target == "agent":
            os.kill(job.proc.pid, signal.SIGTERM)
        else:
            job.kill_worker(1, signal.SIGTERM)
        job.wait(60)
        stopped_in = time.monotonic() - signalled
    finally:
        job.stop()
    # Within the budget (25 s), and no worker had to be SIGKILLed by the agent.
    assert stopped_in < 15, f"the job took {stopped_in:.1f}s to stop"
    events = list(read_events(run_dir / "events.jsonl"))
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    stopped_at = preempted["step"]
    assert 12 <= stopped_at < TINY_DROPOUT_STEPS
    last_step = max(e["step"] for e in events if e["event"] == "step")
    assert last_step == stopped_at                        # every rank stopped at one boundary
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [(e["step"], e["reason"]) for e in saved] == [(stopped_at, "preemption")]
    out = job.output()
    assert "stop requested (preemption): stopped at step" in out
    assert "Traceback" not in out
    assert "Unable to shutdown process" not in out
    if target == "agent":
        assert job.proc.returncode == 143
        assert "elastic-train: stopped by SIGTERM: the workers checkpointed" in out
    else:
        assert job.proc.returncode == 0                   # the agent saw every worker exit 0

    # The same command again.
    rerun = (harness.elastic_run(run_dir, [*JOB, "--max-restarts", "0"]) if target == "agent"
             else harness.torchrun(run_dir, JOB, max_restarts=0))
    assert rerun.wait(TIMEOUT) == 0, rerun.report()
    loaded = [e["step"] for e in read_events(run_dir / "events.jsonl")
              if e["event"] == "checkpoint_loaded"]
    assert loaded == [stopped_at]                         # no step lost
    assert harness.final_digest(run_dir) == reference_digest
