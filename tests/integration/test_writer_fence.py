"""Two worlds over one run directory: the older one never commits a checkpoint again.

A second launch over a run directory that a first one still trains in stands for the
world the rendezvous formed without a partitioned node (or a stale agent's world): it
resumes from the newest checkpoint and claims the next writer epoch. The first world's
next checkpoint is refused before its rename, every rank of it stops with one line, and
every checkpoint committed after the second world's start is the second world's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic_train.checkpoint.storage import MANIFEST
from tests.integration import harness

pytestmark = pytest.mark.slow

STEPS = 150
JOB = ["--task", "tests.integration.paced_task:make_task", "--task-opt", "preset=tiny",
       "--batch-size", "16", "--steps", str(STEPS),
       "--checkpoint-every", "10", "--keep-checkpoints", "50", "--log-every", "50",
       "--nproc-per-node", "2", "--max-restarts", "0"]
OLDER = [*JOB, "--task-opt", "pace=0.1"]
"""The older world trains slowly, so that it is still training (its next checkpoint ahead)
when the newer one has started and claimed the run, however slowly processes start."""
NEWER = JOB  # at full speed: the suite need not wait for its steps
TIMEOUT = 180


def test_the_older_world_stops_without_committing_once_a_newer_world_owns_the_run(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    older = harness.elastic_run(run_dir, OLDER)
    newer = None
    try:
        older.wait_for_event(lambda e: e["event"] == "checkpoint_saved" and e["step"] >= 20,
                             timeout=TIMEOUT)
        newer = harness.elastic_run(run_dir, NEWER)
        fenced = older.wait_for_event(lambda e: e["event"] == "checkpoint_fenced",
                                      timeout=TIMEOUT)
        assert older.wait(60) != 0, older.report()
        assert newer.wait(TIMEOUT) == 0, newer.report()
    finally:
        older.stop()
        if newer is not None:
            newer.stop()
    loaded = [e for e in newer.events() if e["event"] == "checkpoint_loaded"]
    resumed = loaded[0]["step"]
    assert (fenced["epoch"], fenced["newer_epoch"]) == (1, 2)
    assert fenced["step"] > resumed
    # One line: the step every rank stopped at (the vote after the refused write).
    found = re.findall(r"elastic_train: error: stopped at step (\d+): checkpoint (\d+) was "
                       r"not committed: a newer world owns this run's checkpoints \(writer "
                       r"epoch 2 \(host .*, resumed from step (\d+)\)\) and this world "
                       r"\(writer epoch 1\) is no longer part of the job", older.output())
    assert len(found) == 1, older.report()
    stopped, step, resumed_from = map(int, found[0])
    assert step == fenced["step"] and stopped >= step and resumed_from == resumed
    # Every checkpoint after the step the newer world resumed from is the newer world's.
    writers = {}
    for manifest in sorted((run_dir / "checkpoints").glob(f"step-*/{MANIFEST}")):
        record = json.loads(manifest.read_text())
        writers[record["step"]] = record["writer_epoch"]
    assert writers[STEPS] == 2
    assert {s: w for s, w in writers.items() if s > resumed} == \
        {s: 2 for s in range(resumed + 10, STEPS + 1, 10)}
    assert all(w == 1 for s, w in writers.items() if s <= resumed)
