"""The contract of a checkpoint store (elastic_train/checkpoint/api.py), one test run on
every implementation: the filesystem's ``CheckpointStore`` and the object store's
``ObjectCheckpointStore`` against a real S3 server (moto's, a process on loopback). A new
store (GCS, Azure, another filesystem) joins ``STORES`` and must pass the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint.api import CheckpointStorage, Serialized
from elastic_train.checkpoint.object_checkpoints import ObjectCheckpointStore
from elastic_train.checkpoint.object_store import ObjectLocation, ObjectStore
from elastic_train.checkpoint.storage import CheckpointStore, model_digest, serialize
from elastic_train.config import StorageConfig
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow
STORES = ["filesystem", "object-store"]


def payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(32, 32, generator=g)}, "trainer": {"step": step}}


def meta(state: dict) -> dict:
    return {"world_size": 2, "model_digest": model_digest(state["model"])}


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> CheckpointStorage:
    if request.param == "filesystem":
        return CheckpointStore(tmp_path / "checkpoints")
    server, bucket = request.getfixturevalue("s3_bucket")
    assert isinstance(server, S3Server)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    objects = ObjectStore(ObjectLocation(bucket, "run"),
                          StorageConfig(endpoint_url=server.endpoint))
    return ObjectCheckpointStore(objects, "run/checkpoints")


class Fenced(Exception):
    """What the writer fence raises before a stale world's commit (fence.py)."""


def write(store: CheckpointStorage, step: int, **kwargs: object) -> None:
    state = payload(step)
    store.write(step, state, meta(state), **kwargs)  # type: ignore[arg-type]


def test_it_is_the_declared_contract(store: CheckpointStorage) -> None:
    assert isinstance(store, CheckpointStorage)
    assert store.remote == isinstance(store, ObjectCheckpointStore)


def test_a_commit_is_listed_verified_and_loaded_bitwise(store: CheckpointStorage) -> None:
    for step in (10, 20, 30):
        write(store, step)
    listed = store.list()
    assert [i.step for i in listed] == [30, 20, 10]      # newest first
    for info in listed:
        assert info.problem is None and info.world_size == 2
        assert store.verify(info).valid
        loaded = store.load(info)
        assert torch.equal(loaded["model"]["w"], payload(info.step)["model"]["w"])
        assert info.model_digest == model_digest(payload(info.step)["model"])
        chosen = store.locate(str(info.path), info.step)   # rank 0's choice, on another rank
        assert torch.equal(store.load(chosen)["model"]["w"], loaded["model"]["w"])


def test_a_serialized_payload_commits_the_same_bytes(store: CheckpointStorage) -> None:
    state = payload(5)
    serialized = serialize(state)
    assert isinstance(serialized, Serialized)
    store.write(5, serialized, meta(state))
    (info,) = store.list()
    assert store.verify(info).valid and info.size_bytes == serialized.bytes
    assert torch.equal(store.load(info)["model"]["w"], state["model"]["w"])


def test_a_save_abandoned_before_its_commit_is_never_listed_and_harms_nothing(
        store: CheckpointStorage) -> None:
    write(store, 10)

    def fenced() -> None:
        raise Fenced("a newer world owns the run")

    with pytest.raises(Fenced):
        write(store, 20, before_commit=fenced)
    assert [i.step for i in store.list()] == [10]
    assert store.verify(store.list()[0]).valid
    store.remove_leftovers()
    assert store.leftovers() == [] and [i.step for i in store.list()] == [10]


@pytest.mark.parametrize("stage", ["tmp-created", "payload-written", "payload-synced",
                                   "manifest-synced"])
def test_a_save_that_fails_at_any_stage_leaves_the_committed_ones(
        store: CheckpointStorage, stage: str) -> None:
    write(store, 10)

    def crash_at(at: str) -> Callable[[str], None]:
        def hook(reached: str) -> None:
            if reached == at:
                raise OSError(f"crashed at {at}")
        return hook

    with pytest.raises(OSError, match=f"crashed at {stage}"):
        write(store, 20, fault_hook=crash_at(stage))
    assert [i.step for i in store.list()] == [10]
    store.remove_leftovers()
    assert store.leftovers() == []
    write(store, 20)                          # the step can be saved again
    assert [i.step for i in store.list()] == [20, 10]


def test_retention_keeps_the_newest_and_deletes_the_oldest(store: CheckpointStorage) -> None:
    for step in range(1, 6):
        write(store, step)
    store.apply_retention(2, newest=5)
    assert [i.step for i in store.list()] == [5, 4]
    store.apply_retention(1, newest=5)
    assert [i.step for i in store.list()] == [5]


def test_a_corrupt_checkpoint_is_found_and_set_aside_with_its_bytes_kept(
        store: CheckpointStorage) -> None:
    write(store, 10)
    write(store, 20)
    newest = store.list()[0]
    files = dict((newest.manifest or {})["files"])
    aside = store.set_aside(newest)
    assert [i.step for i in store.list()] == [10]
    assert [str(p) for p in store.set_aside_dirs()] == [str(aside)]
    kept = store.read_info(aside, 20)                # its manifest and bytes are still there
    assert kept.manifest is not None and dict(kept.manifest["files"]) == files
    older = store.list()[0]                          # a manifest naming bytes not there
    broken = type(older)(older.path, older.step, {
        **dict(older.manifest or {}), "files": {"missing.pt": {"bytes": 1, "sha256": "0" * 64}}})
    verdict = store.verify(broken)
    assert not verdict.valid and verdict.problem
