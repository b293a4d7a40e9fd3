"""Checkpoints in an object store, against a real S3 server (moto's, a process on loopback).

The store's promises, as on disk: a checkpoint exists only once its manifest is written
(last, with checksums); a save killed at any stage leaves no checkpoint and no damage; the
leftovers are removed without touching anything that is not ours; retention and the writer
fence work without a filesystem; every failure is one line naming the endpoint or bucket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from elastic_train.checkpoint.fence import ObjectWriterFence
from elastic_train.checkpoint.object_checkpoints import ObjectCheckpointStore
from elastic_train.checkpoint.object_store import ObjectLocation, ObjectStore
from elastic_train.checkpoint.storage import model_digest
from elastic_train.config import StorageConfig
from elastic_train.errors import CheckpointFencedError, StorageRefusedError, StorageUnavailableError
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow


def _payload(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "trainer": {"step": step}}


def _store(server: S3Server, bucket: str, prefix: str = "run", **opts: object
           ) -> tuple[ObjectStore, ObjectCheckpointStore]:
    options = StorageConfig(endpoint_url=server.endpoint, **opts)  # type: ignore[arg-type]
    objects = ObjectStore(ObjectLocation(bucket, prefix), options)
    return objects, ObjectCheckpointStore(objects, f"{prefix}/checkpoints")


def _write(store: ObjectCheckpointStore, step: int, **kwargs: object) -> None:
    payload = _payload(step)
    store.write(step, payload, {"world_size": 1, "model_digest": model_digest(payload["model"])},
                **kwargs)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, s3_bucket: tuple[S3Server, str]) -> None:
    for key, value in s3_bucket[0].env().items():
        monkeypatch.setenv(key, value)


def test_commit_list_verify_load_and_retention(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    _, store = _store(server, bucket)
    for step in range(1, 6):
        _write(store, step)
        store.apply_retention(3, newest=step)
    infos = store.list()
    assert [i.step for i in infos] == [5, 4, 3]
    for info in infos:
        verdict = store.verify(info)
        assert verdict.valid, verdict.problem
        assert verdict.checked_bytes == info.size_bytes > 0
    loaded = store.load(store.locate(str(infos[0].path), 5))
    assert model_digest(loaded["model"]) == model_digest(_payload(5)["model"])
    assert store.leftovers() == []


def _killed_writer(server: S3Server, bucket: str, step: int, stage: str) -> None:
    """A child process that writes checkpoint ``step`` and is SIGKILLed at ``stage``."""
    code = f"""
import os, signal, torch
from tests.integration.test_object_store_checkpoints import _store, _write
from tests.s3_server import S3Server
server = S3Server.__new__(S3Server); server.address, server.port = {server.address!r}, {server.port}
_, store = _store(server, {bucket!r})
def hook(stage):
    if stage == {stage!r}:
        os.kill(os.getpid(), signal.SIGKILL)
_write(store, {step}, fault_hook=hook)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                          env={**os.environ, **server.env()}, timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("stage", ["payload-synced", "manifest-synced"])
def test_a_save_killed_mid_upload_leaves_no_checkpoint_and_its_leftovers_go(
        s3_bucket: tuple[S3Server, str], stage: str) -> None:
    server, bucket = s3_bucket
    objects, store = _store(server, bucket)
    _write(store, 10)
    _killed_writer(server, bucket, 20, stage)
    # A multipart upload that never completed (a big payload's upload, killed).
    key = "run/checkpoints/step-00000030/state-0123456789ab.pt"
    server.client().create_multipart_upload(Bucket=bucket, Key=key)
    assert [i.step for i in store.list()] == [10]
    leftovers = store.leftovers()
    assert any("step-00000020/state-" in p for p in leftovers), leftovers
    assert any("(incomplete upload)" in p for p in leftovers), leftovers
    removed = store.remove_leftovers()
    assert sorted(removed) == sorted(leftovers)
    assert store.leftovers() == []
    assert objects.incomplete_uploads("run/") == []
    (info,) = store.list()
    assert store.verify(info).valid


def test_objects_that_are_not_ours_are_never_deleted(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    objects, store = _store(server, bucket)
    _write(store, 5)
    foreign = ["run/checkpoints/README", "run/checkpoints/step-00000007/notes.txt",
               "run/checkpoints/step-00000005/extra.bin", "run/other/data.bin"]
    for key in foreign:
        objects.put(key, b"not a checkpoint")
    objects.put("run/checkpoints/step-00000009/manifest.json", json.dumps({"a": 1}).encode())
    infos = store.list()
    assert [i.step for i in infos] == [9, 5]
    assert infos[0].problem == "manifest.json is not an elastic_train manifest"
    assert not store.verify(infos[0]).valid and store.verify(infos[1]).valid
    assert store.remove_leftovers() == []
    store.apply_retention(1, newest=5)
    keys = {o.key for o in objects.list("run/")}
    assert set(foreign) | {"run/checkpoints/step-00000009/manifest.json"} <= keys


def test_a_checkpoint_rewritten_at_its_step_sets_the_old_one_aside(
        s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    objects, store = _store(server, bucket)
    _write(store, 8)
    old = {o.key for o in objects.list("run/checkpoints/step-00000008/")}
    _write(store, 8)
    (info,) = store.list()
    assert store.verify(info).valid
    aside = store.set_aside_dirs()
    assert len(aside) == 1 and ".corrupt-" in aside[0]
    kept = {o.key.rsplit("/", 1)[-1] for o in objects.list("run/checkpoints/")
            if ".corrupt-" in o.key}
    assert kept == {k.rsplit("/", 1)[-1] for k in old}


def test_the_writer_fence_claims_by_conditional_write(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    objects, _ = _store(server, bucket)
    epochs: list[int] = []
    lock = threading.Lock()

    def claim() -> None:
        fence = ObjectWriterFence(ObjectStore(objects.location, objects.options), "run/writers")
        epoch = fence.claim(None, "run")
        with lock:
            epochs.append(epoch)

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(epochs) == [1, 2, 3, 4, 5, 6]  # no two worlds hold the same epoch
    fence = ObjectWriterFence(objects, "run/writers")
    fence.check(6, step=1)
    with pytest.raises(CheckpointFencedError):
        fence.check(5, step=1)
    # An epoch object cannot be overwritten once there.
    assert objects.put("run/writers/epoch-00000003", b"{}", if_absent=True) is False


def test_a_missing_bucket_is_one_line(s3_bucket: tuple[S3Server, str]) -> None:
    server, _ = s3_bucket
    _, store = _store(server, "no-such-bucket")
    with pytest.raises(StorageRefusedError) as caught:
        store.list()
    assert str(caught.value) == (
        f"bucket no-such-bucket does not exist at {server.endpoint} (listing "
        "s3://no-such-bucket/run/checkpoints): create it, or fix the bucket in --run-dir")


def test_a_frozen_endpoint_fails_in_bounded_time_naming_it(
        s3_bucket: tuple[S3Server, str]) -> None:
    server = S3Server.start()
    try:
        server.make_bucket("frozen")
        _, store = _store(server, "frozen", read_timeout=1.0, connect_timeout=1.0, max_attempts=1)
        _write(store, 1)
        server.freeze()
        with pytest.raises(StorageUnavailableError) as caught:
            store.list()
        assert str(caught.value).startswith(f"object store {server.endpoint} is not "
                                            "reachable (listing s3://frozen/run/checkpoints: ")
        server.thaw()
        assert [i.step for i in store.list()] == [1]
    finally:
        server.stop()
