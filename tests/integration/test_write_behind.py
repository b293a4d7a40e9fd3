"""The object store written behind the memory tier (agent/write_behind.py): the agent's
holder uploads the payload it keeps, the worker commits the manifest; against a real S3
server (moto's, a process on loopback) and real holders (in this process, or in a child
process with an environment of its own).

- what a holder is offered it uploads, byte for byte, to a payload's key and nowhere else;
- a step it does not hold, or a key that is not a payload's, is refused and nothing is
  written; a frozen store is the store's own line, within the client's timeouts;
- a save of a checkpoint manager with an ``s3://`` store and a holder: the agent uploads,
  the worker commits, the checkpoint verifies and loads bitwise (``uploaded_by: agent``);
- a holder whose agent has no credentials: the worker uploads the payload itself (it has
  them) and the checkpoint is the same (``uploaded_by: worker``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.agent.snapshot_holder import SnapshotHolder
from elastic_train.checkpoint.manager import CheckpointManager
from elastic_train.checkpoint.object_checkpoints import ObjectCheckpointStore
from elastic_train.checkpoint.object_store import ObjectLocation, ObjectStore
from elastic_train.checkpoint.storage import model_digest
from elastic_train.config import CheckpointConfig, StorageConfig
from elastic_train.errors import MemoryTierError, StorageUnavailableError
from elastic_train.events.log import EventLog, read_events
from elastic_train.live.memory_tier import Endpoint
from elastic_train.worker.distributed import Group
from elastic_train.worker.memory_tier import MemoryTierClient
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow

RUN = "run-behind"
GROUP = Group(0, 1, "gloo", torch.device("cpu"))
PAYLOAD_NAME = "step-00000007/state-0123456789ab.pt"


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, s3_bucket: tuple[S3Server, str]) -> None:
    for key, value in s3_bucket[0].env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def holder() -> Iterator[SnapshotHolder]:
    with SnapshotHolder("127.0.0.1", run_id=RUN) as held:
        yield held


def _objects(server: S3Server, bucket: str, **opts: Any) -> ObjectStore:
    return ObjectStore(ObjectLocation(bucket, "job"),
                       StorageConfig(endpoint_url=server.endpoint, **opts))


def _offered(client: MemoryTierClient, step: int, size: int = 3 << 20
             ) -> tuple[dict[str, Any], bytes]:
    payload = os.urandom(size)
    manifest = {"writer_epoch": 0, "step": step, "bytes": size,
                "sha256": hashlib.sha256(payload).hexdigest()}
    assert client.offer(manifest, payload) == 1
    return manifest, payload


def test_the_holder_uploads_what_it_keeps_to_a_payload_key_and_nothing_else(
        s3_bucket: tuple[S3Server, str], holder: SnapshotHolder) -> None:
    server, bucket = s3_bucket
    client, objects = MemoryTierClient(holder.endpoint, RUN), _objects(server, bucket)
    manifest, payload = _offered(client, 7)
    key = f"job/checkpoints/{PAYLOAD_NAME}"
    seconds = client.upload(manifest, f"s3://{bucket}/{key}", objects.client_options())
    assert seconds > 0
    assert objects.get(key) == payload

    with pytest.raises(MemoryTierError, match="is not a checkpoint payload's key: a holder "
                                              "writes nothing else"):
        client.upload(manifest, f"s3://{bucket}/job/manifest.json", objects.client_options())
    with pytest.raises(MemoryTierError, match=r"step 8 \(writer epoch 0\) is not held here"):
        client.upload({**manifest, "step": 8}, f"s3://{bucket}/{key}8",
                      objects.client_options())
    with pytest.raises(MemoryTierError, match="unknown storage options credentials"):
        client.upload(manifest, f"s3://{bucket}/{key}",
                      {**objects.client_options(), "credentials": "x"})
    assert [o.key for o in objects.list("job/")] == [key]


def test_a_frozen_store_is_the_stores_own_line_within_its_timeouts(
        holder: SnapshotHolder, tmp_path: Path) -> None:
    server = S3Server.start()
    try:
        server.make_bucket("frozen")
        client = MemoryTierClient(holder.endpoint, RUN)
        objects = _objects(server, "frozen", connect_timeout=1, read_timeout=1, max_attempts=1)
        manifest, _ = _offered(client, 7)
        server.freeze()
        began = time.monotonic()
        with pytest.raises(StorageUnavailableError) as raised:
            client.upload(manifest, f"s3://frozen/job/checkpoints/{PAYLOAD_NAME}",
                          objects.client_options())
        took = time.monotonic() - began
    finally:
        server.stop()
    assert str(raised.value).startswith(f"object store {server.endpoint} is not reachable "
                                        "(uploading s3://frozen/job/checkpoints/step-00000007")
    assert took < 30, took


def _save(tmp_path: Path, server: S3Server, bucket: str, endpoint: Endpoint
          ) -> tuple[dict[str, Any], ObjectCheckpointStore, dict[str, Any]]:
    """One checkpoint of a small model, saved by a manager whose memory tier is the holder
    at ``endpoint``; its ``checkpoint_saved`` event, the store, and what was saved."""
    objects = _objects(server, bucket)
    store = ObjectCheckpointStore(objects, "job/checkpoints")
    events = tmp_path / "events.jsonl"
    manager = CheckpointManager(store, GROUP, CheckpointConfig(every_steps=1, keep=2),
                                EventLog(events), meta={"run_id": RUN},
                                memory=MemoryTierClient(endpoint, RUN))
    model = torch.nn.Linear(64, 64)
    manager.save(3, {"model": model}, wait=True)
    saved = [e for e in read_events(events) if e["event"] == "checkpoint_saved"]
    assert len(saved) == 1, saved
    return saved[0], store, {"model": model.state_dict()}


def test_a_save_is_uploaded_by_the_agent_and_committed_by_the_worker(
        s3_bucket: tuple[S3Server, str], holder: SnapshotHolder, tmp_path: Path) -> None:
    server, bucket = s3_bucket
    saved, store, state = _save(tmp_path, server, bucket, holder.endpoint)
    assert saved["uploaded_by"] == "agent" and saved["memory_copies"] == 1, saved
    info, = store.list()
    assert store.verify(info).valid
    loaded = store.load(info)
    assert model_digest(loaded["model"]) == model_digest(state["model"]) == saved["model_digest"]
    assert store.leftovers() == []


def test_an_agent_without_credentials_leaves_the_upload_to_the_worker(
        s3_bucket: tuple[S3Server, str], tmp_path: Path) -> None:
    server, bucket = s3_bucket
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")})
    code = ("import json, sys, time\n"
            "from elastic_train.agent.snapshot_holder import SnapshotHolder\n"
            f"h = SnapshotHolder('127.0.0.1', run_id={RUN!r}).start()\n"
            "print(h.endpoint.to_json(), flush=True)\n"
            "sys.stdin.read()\n")
    agent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert agent.stdout is not None
        endpoint = Endpoint.from_json(agent.stdout.readline())
        saved, store, state = _save(tmp_path, server, bucket, endpoint)
    finally:
        agent.communicate("", timeout=30)
    assert saved["uploaded_by"] == "worker" and saved["memory_copies"] == 1, saved
    info, = store.list()
    assert store.verify(info).valid
    assert model_digest(store.load(info)["model"]) == model_digest(state["model"])
    assert json.loads(json.dumps(saved))["model_digest"] == model_digest(state["model"])
