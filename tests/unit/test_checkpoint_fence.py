"""Writer epochs: a stale world never commits a checkpoint once a newer world owns the run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint.fence import Claim, WriterFence, superseded
from elastic_train.checkpoint.manager import CheckpointManager
from elastic_train.checkpoint.storage import CheckpointStore, model_digest
from elastic_train.config import CheckpointConfig
from elastic_train.errors import CheckpointFencedError
from elastic_train.events.log import EventLog, read_events
from elastic_train.rundir import RunDir
from elastic_train.worker.distributed import Group

GROUP = Group(0, 1, "gloo", torch.device("cpu"))


def world(run: RunDir, name: str) -> CheckpointManager:
    """One world over the run directory, as the runtime builds it (synchronous writes)."""
    return CheckpointManager(CheckpointStore(run.checkpoints), GROUP,
                             CheckpointConfig(every_steps=1, keep=10, asynchronous=False),
                             EventLog(run.root / f"events-{name}.jsonl"), {"run_id": name},
                             fence=WriterFence(run.writers))


def events(run: RunDir, name: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run.root / f"events-{name}.jsonl") if e["event"] == kind]


def test_claims_are_exclusive_and_a_racing_world_takes_the_next_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fence = WriterFence(tmp_path / "writers")
    assert fence.claim(None, "a") == 1
    assert WriterFence(tmp_path / "writers").claim(10, "b") == 2
    # A world that claimed epoch 3 between our read and our create: we take 4.
    (tmp_path / "writers" / "epoch-00000003").write_text("")
    with monkeypatch.context() as patched:  # as if we read the directory before it came
        patched.setattr(fence, "newest", lambda: Claim(2, 10))
        assert fence.claim(20, "c") == 4
    assert [c.epoch for c in fence.claims()] == [1, 2, 3, 4]
    assert [c.resumed_from for c in fence.claims()] == [None, 10, None, 20]
    fence.check(4, 30)
    with pytest.raises(CheckpointFencedError, match=r"^checkpoint 30 was not committed: a "
                       r"newer world owns this run's checkpoints \(writer epoch 4 \(host .*, "
                       r"resumed from step 20\)\) and this world \(writer epoch 2\) is no "
                       r"longer part of the job"):
        fence.check(2, 30)


BEFORE = [Claim(1, None), Claim(2, 10)]   # epoch 2 resumed from step 10


@pytest.mark.parametrize(("written_by", "step", "claims", "expected"), [
    (None, 500, BEFORE, False),  # written before writer epochs existed
    (2, 500, BEFORE, False),     # by the newest world
    (1, 10, BEFORE, False),      # the step the newer world resumed from: shared history
    (1, 5, BEFORE, False),
    (1, 11, BEFORE, True),       # committed after the newer world forked from step 10
    (2, 30, [*BEFORE, Claim(3, None)], True),  # epoch 3 started from scratch
])
def test_superseded(written_by: int | None, step: int, claims: list[Claim],
                    expected: bool) -> None:
    assert superseded(written_by, step, claims) is expected


def test_a_stale_world_stops_committing_and_its_late_commit_is_never_restored(
        tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run").prepare()
    model = torch.nn.Linear(4, 4)
    old = world(run, "old")
    assert old.restore({"model": model}) is None and old.epoch == 1
    old.save(10, {"model": model}, wait=True)
    # A newer world forms over the same run directory and resumes from 10.
    newer = world(run, "newer")
    newer_model = torch.nn.Linear(4, 4)
    restored = newer.restore({"model": newer_model})
    assert restored is not None and restored.step == 10 and newer.epoch == 2
    # The stale world's next checkpoint is refused before its rename: nothing committed.
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointFencedError):
        old.save(20, {"model": model}, wait=True)
    assert old.fenced is not None
    assert sorted(os.listdir(run.checkpoints)) == ["step-00000010"]
    (fenced,) = events(run, "old", "checkpoint_fenced")
    assert (fenced["step"], fenced["epoch"], fenced["newer_epoch"]) == (20, 1, 2)
    # The newer world writes on; the stale world's bytes never replaced its checkpoint.
    newer.save(20, {"model": newer_model}, wait=True)
    # A commit that slipped in between the stale world's check and its rename ...
    CheckpointStore(run.checkpoints).write(30, {"model": model.state_dict()},
                                           {"writer_epoch": 1, "world_size": 1})
    # ... is skipped by every later restore: it forked off the newer world's history.
    later = world(run, "later")
    loaded = torch.nn.Linear(4, 4)
    restored = later.restore({"model": loaded})
    assert restored is not None and restored.step == 20 and later.epoch == 3
    assert model_digest(loaded.state_dict()) == model_digest(newer_model.state_dict())
    (skipped,) = events(run, "later", "checkpoint_skipped")
    assert skipped["step"] == 30 and skipped["problem"].startswith(
        "superseded: written by writer epoch 1 after a newer world had resumed")
