"""Chaos: SIGKILL random workers at random moments (one inside a checkpoint's persist).

The job always finishes, its final weights equal an uninterrupted run's, and every
checkpoint it ever loaded was complete (its weights are those of the uninterrupted run at
that step). ``ET_CHAOS_KILLS`` raises the number of kills (the soak variant).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from elastic_train.events.log import read_events
from tests.integration import harness
from tests.integration.harness import TINY_DROPOUT_STEPS

# The restart path's kills are proven in the default suite by test_exact_resume.py (four
# chosen moments) and live recovery's by test_live_recovery.py; random ones: make test-extended.
pytestmark = [pytest.mark.slow, pytest.mark.extended]

KILLS = int(os.environ.get("ET_CHAOS_KILLS", "3"))
STEPS = max(TINY_DROPOUT_STEPS, 15 * KILLS)
JOB = ["--preset", "tiny", "--batch-size", "64", "--steps", str(STEPS),
       "--checkpoint-every", "5", "--keep-checkpoints", str(STEPS), "--log-every", "20",
       "--task-opt", "dropout=0.1"]


@pytest.fixture
def ref(tmp_path: Path, request: pytest.FixtureRequest) -> dict[int, str]:
    """{step: digest} of JOB uninterrupted (the shared reference, unless the soak variant
    runs more steps)."""
    if STEPS == TINY_DROPOUT_STEPS:
        return request.getfixturevalue("tiny_dropout_reference")
    return harness.uninterrupted_digests(tmp_path / "reference", JOB)


def test_random_kills_never_change_the_result(tmp_path: Path, ref: dict[int, str]) -> None:

    rng = random.Random(int(os.environ.get("ET_CHAOS_SEED", "7")))
    job = harness.elastic_run(tmp_path / "chaos", [*JOB, "--max-restarts", str(KILLS + 2),
                                                  "--recovery", "restart"])
    kills = []
    try:
        for n in range(KILLS):
            restart = n
            # Let the incarnation train a little, then strike.
            job.wait_for_event(lambda e, r=restart: e["event"] == "step"
                               and e.get("restart") == r, timeout=120)
            if n % 3 == 1:  # inside a persist: rank 0 right after a checkpoint step
                job.wait_for_event(lambda e, r=restart: e["event"] == "step"
                                   and e.get("restart") == r and e["step"] % 5 == 0,
                                   timeout=120)
                rank = 0
            else:
                time.sleep(rng.uniform(0.0, 1.5))
                rank = rng.randrange(2)
            job.kill_worker(rank)
            kills.append(rank)
            job.wait_for_event(lambda e, r=restart: e["event"] == "start"
                               and e.get("restart") == r + 1, timeout=120)
        assert job.wait(300) == 0, job.report()
    finally:
        job.stop()
    events = list(read_events(job.run_dir / "events.jsonl"))
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert len(loaded) <= KILLS
    for e in loaded:  # every checkpoint ever loaded was complete and right
        assert e["model_digest"] == ref[e["step"]], e
    assert harness.final_digest(job.run_dir) == ref[STEPS]
    redone = sum(1 for _ in events if _["event"] == "step") - STEPS
    print(f"\nchaos: {len(kills)} kills (ranks {kills}), {len(loaded)} restores, "
          f"{redone} steps redone, 0 incomplete checkpoints loaded")
