"""A sharded checkpoint's commit (checkpoint/sharded_save.py) when a rank dies writing its shard:
real processes SIGKILLed at random moments of their write, on a real filesystem.

After every kill: either rank 0 committed (every rank's shard was in; the checkpoint
verifies and its parts assemble into the tensors written), or it gave up after its wait
with one line naming the missing rank and left no ``step-N`` directory; the previous
checkpoint verifies either way, and removing the leftovers touches no checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint import sharded, sharded_restore, sharded_save
from elastic_train.checkpoint.storage import CheckpointStore
from elastic_train.errors import StorageError

pytestmark = pytest.mark.slow

WORLD = 2
ROWS = 4096  # a 2 MiB tensor per rank: a write takes milliseconds


def _whole(step: int) -> torch.Tensor:
    return torch.randn(WORLD * ROWS, 64, generator=torch.Generator().manual_seed(step))


def _shot(step: int, rank: int) -> sharded.ShardedSnapshot:
    """What rank ``rank`` of a 2-rank FSDP job snapshots of one sharded tensor."""
    part = _whole(step)[rank * ROWS:(rank + 1) * ROWS].clone()
    key = f"model/w@{rank * ROWS},0"
    common = {"model": {"w": {sharded.MARK: "model/w"}}, "trainer": {"step": step}} \
        if rank == 0 else None
    return sharded.ShardedSnapshot(rank, WORLD, [sharded.Part(
        "model/w", key, [rank * ROWS, 0], [ROWS, 64], [WORLD * ROWS, 64], "float32")],
        {key: part}, common)


def _save(store: CheckpointStore, step: int, timeout: float) -> None:
    staging = sharded.staging_dir(store.root, step, epoch=step)
    for rank in range(WORLD):
        sharded_save.write_rank(staging, _shot(step, rank))
    sharded_save.commit(store, step, staging, WORLD, {}, timeout=timeout)


def test_a_rank_killed_writing_its_shard_never_leaves_a_torn_checkpoint(tmp_path: Path
                                                                         ) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    _save(store, 1, timeout=5)
    rng = random.Random(7)
    outcomes = {"committed": 0, "given up": 0}
    for step in range(2, 14):
        staging = sharded.staging_dir(store.root, step, epoch=step)
        sharded_save.write_rank(staging, _shot(step, 0))
        pid = os.fork()
        if pid == 0:  # rank 1: writes its shard, killed at a random moment
            try:
                sharded_save.write_rank(staging, _shot(step, 1))
            finally:
                os._exit(0)
        if rng.random() < 0.8:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        try:
            info = sharded_save.commit(store, step, staging, WORLD, {}, timeout=0.5)
        except StorageError as exc:
            outcomes["given up"] += 1
            assert str(exc).startswith(f"ranks [1] wrote no shard of this checkpoint into "
                                       f"{staging} within 0.5 s: a rank died"), exc
            assert not (store.root / f"step-{step:08d}").exists()
        else:
            outcomes["committed"] += 1
            assert store.verify(info).valid
            parts = sharded_restore.full_tensors(info.path, info.manifest["sharded"]["tensors"],
                                         "model/")
            assert torch.equal(parts["w"], _whole(step))
        for leftover in store.remove_leftovers():
            assert leftover.name.startswith(".tmp-")
        newest = store.list()[0]
        assert store.verify(newest).valid
    assert outcomes["given up"] > 0, outcomes
    assert all(store.verify(info).valid for info in store.list())


def _torchrun(nproc: int, *args: str) -> None:
    import subprocess
    import sys

    from tests.integration import harness

    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(Path(__file__).with_name("sharded_parts_worker.py")),
         *args], env=harness.job_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_memory_tiers_parts_reshard_to_any_world_reading_only_the_parts_needed(
        tmp_path: Path) -> None:
    """Parts of a save at world 4 (FSDP2 over 4 real gloo ranks), as each rank offers its
    own to the memory tier, loaded at world 2 and 3: every parameter and Adam moment whole
    is the saved one, bit for bit, and each rank read the common state (its own part) and
    only the parts its rows overlap (16 rows: 4 per saved part)."""
    _torchrun(4, "save", str(tmp_path))
    for world, reads in ((2, [3, 3]), (3, [3, 3, 2])):
        _torchrun(world, "load", str(tmp_path))
        found = [json.loads((tmp_path / f"load-{world}-{r}.json").read_text())
                 for r in range(world)]
        assert [f["equal"] for f in found] == [True] * world, found
        assert [f["step"] for f in found] == [2] * world
        assert [f["read"] for f in found] == reads, found
