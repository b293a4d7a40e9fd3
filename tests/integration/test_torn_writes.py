"""Torn writes: SIGKILL a process that is writing checkpoints, hundreds of times, at random.

After every kill: each ``step-N`` directory verifies (a torn save can only leave a ``.tmp-``
leftover, never a checkpoint), the newest valid checkpoint is the newest one written, and
removing leftovers touches no checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint.storage import CheckpointStore, model_digest

pytestmark = pytest.mark.slow

TRIALS = int(os.environ.get("ET_TORN_TRIALS", "200"))


def _payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    weights = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)}
    return {"model": weights, "optimizer": {"state": {0: {"m": torch.randn(64, 256,
                                                                       generator=g)}}},
            "trainer": {"step": step}}


def _writer(root: Path, first_step: int) -> None:
    store = CheckpointStore(root)
    step = first_step
    while True:
        payload = _payload(step)
        store.write(step, payload, {"world_size": 1,
                                    "model_digest": model_digest(payload["model"])})
        store.apply_retention(3, newest=step)
        step += 1


def test_killed_writers_never_leave_a_torn_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    rng = random.Random(1234)
    store = CheckpointStore(root)
    next_step, kills, leftovers_seen = 1, 0, 0
    deadline = time.monotonic() + 240
    for _ in range(TRIALS):
        assert time.monotonic() < deadline, f"only {kills} trials within the time limit"
        pid = os.fork()
        if pid == 0:  # the writer: never returns
            try:
                _writer(root, next_step)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
        infos = store.list()
        for info in infos:  # every checkpoint directory is complete
            verdict = store.verify(info)
            assert verdict.valid, (info.path, verdict.problem)
            assert info.model_digest == model_digest(_payload(info.step)["model"])
        leftovers = store.leftovers()
        leftovers_seen += bool(leftovers)
        before = {i.path for i in infos}
        store.remove_leftovers()
        assert {i.path for i in store.list()} == before
        assert not store.leftovers()
        if infos:
            next_step = infos[0].step + 1
    assert kills == TRIALS
    assert leftovers_seen > TRIALS // 10, "the kills should often land inside a save"
    print(f"\ntorn-write trials: {kills} kills, {leftovers_seen} left a torn save behind, "
          f"0 torn checkpoints, newest step {next_step - 1}")
