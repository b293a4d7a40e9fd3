"""Which kind of checkpoint a job may resume (checkpoint/storage.py ``check_kind``): the
launcher's pre-check and every worker's restore refuse the other kind with the same line."""

from __future__ import annotations

import pytest

from elastic_train.checkpoint.storage import SHARDED, check_kind
from elastic_train.errors import CheckpointMismatchError

UNSHARDED_MANIFEST = {"step": 10, "files": {}}
SHARDED_MANIFEST = {"step": 10, SHARDED: {"world_size": 2}}


def test_the_same_kind_is_accepted() -> None:
    check_kind("run/checkpoints/step-00000010", UNSHARDED_MANIFEST, job_sharded=False)
    check_kind("run/checkpoints/step-00000010", SHARDED_MANIFEST, job_sharded=True)


def test_a_sharded_checkpoint_is_refused_by_an_unsharded_job() -> None:
    with pytest.raises(CheckpointMismatchError) as caught:
        check_kind("run/checkpoints/step-00000010", SHARDED_MANIFEST, job_sharded=False)
    assert str(caught.value) == (
        "checkpoint run/checkpoints/step-00000010 is sharded (--parallelism fsdp or hsdp) and "
        "this job is unsharded (--parallelism ddp): resume it with the --parallelism that "
        "wrote it, or start a new --run-dir from its weights (elastic-train checkpoints "
        "export)")
    assert caught.value.exit_code == 3


def test_an_unsharded_checkpoint_is_refused_by_a_sharded_job() -> None:
    with pytest.raises(CheckpointMismatchError) as caught:
        check_kind("run/checkpoints/step-00000010", UNSHARDED_MANIFEST, job_sharded=True)
    assert str(caught.value).startswith(
        "checkpoint run/checkpoints/step-00000010 is unsharded (--parallelism ddp) and this "
        "job is sharded (--parallelism fsdp or hsdp): ")
