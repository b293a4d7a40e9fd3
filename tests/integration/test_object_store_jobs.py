"""Real jobs whose run directory is an object store (``--run-dir s3://``), against moto's S3
server as a process on loopback; no run directory on any filesystem.

- rank 0 SIGKILLed while its upload hangs: the restart resumes from the previous checkpoint,
  the torn upload is never restored and is cleaned up, and every checkpoint and the final
  weights equal, bit for bit, those of the same job trained without interruption on disk;
- the endpoint frozen during a save: training goes on, the failure is recorded with the
  job's policy, the next checkpoints are written once it answers again, same weights;
  every payload is uploaded by the agent behind its memory tier (agent/write_behind.py);
- a resize from 2 to 3 workers through the object store: each sample once per epoch, read
  back from the nodes' uploaded sample records;
- bad input (a missing bucket, refused credentials, an endpoint that is down, a foreign
  object under the prefix): one line each, a non-zero exit, nothing deleted.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train import cli
from elastic_train.checkpoint.storage import model_digest
from elastic_train.config import StorageConfig
from elastic_train.rundir import RunDir
from tests.integration import harness
from tests.integration.test_exact_resume import JOB as SAMPLED_JOB
from tests.integration.test_exact_resume import assert_each_sample_once
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow

TIMEOUT = 180
EXACT_JOB = [*harness.TINY_DROPOUT, "--checkpoint-every", "5", "--keep-checkpoints",
             str(harness.TINY_DROPOUT_STEPS), "--log-every", "20"]


def s3_args(server: S3Server, url: str, local: Path, *extra: str) -> list[str]:
    return ["--run-dir", url, "--storage-opt", f"endpoint_url={server.endpoint}",
            "--storage-opt", f"local_dir={local}", *extra]


def local_root(server: S3Server, url: str, local: Path) -> Path:
    """Where rank 0's node keeps its event log of ``url`` (the harness waits on it)."""
    return RunDir(url, StorageConfig(endpoint_url=server.endpoint, local_dir=str(local))).root


def listing(server: S3Server, url: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["checkpoints", "list", url, "--json", "--storage-opt",
                         f"endpoint_url={server.endpoint}"]) == 0
    return json.loads(out.getvalue())


def gathered_events(server: S3Server, url: str, local: Path) -> list[dict[str, Any]]:
    path = RunDir(url, StorageConfig(endpoint_url=server.endpoint,
                                     local_dir=str(local / "reader"))).gathered_events()
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's boto3 (the CLI's main, called in-process) finds the test credentials."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)


def test_rank0_killed_mid_upload_resumes_bitwise_from_the_previous_checkpoint(
        tiny_dropout_reference: dict[int, str], tmp_path: Path, aws: None) -> None:
    server = S3Server.start()
    try:
        server.make_bucket("exact")
        url, local = "s3://exact/job", tmp_path / "local"
        job = harness.torchrun(tmp_path / "run", [*EXACT_JOB, *s3_args(server, url, local)],
                               env=harness.job_env(server.env()), max_restarts=2)
        job.run_dir = local_root(server, url, local)
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved" and e["step"] == 15,
                           TIMEOUT)
        server.freeze()  # the upload of step 20 hangs
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 21, TIMEOUT)
        os.kill(job.worker_pids()[0], signal.SIGKILL)  # its upload dies with it
        server.thaw()
        assert job.wait(TIMEOUT) == 0, job.report()
        rows = listing(server, url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["checkpoints", "export", url, str(tmp_path / "final.pt"),
                             "--storage-opt", f"endpoint_url={server.endpoint}"]) == 0
    finally:
        server.stop()
    final = tiny_dropout_reference[harness.TINY_DROPOUT_STEPS]
    assert f"exported step {harness.TINY_DROPOUT_STEPS} of {url} " in out.getvalue()
    assert f"model sha256 {final}) to " in out.getvalue()
    assert model_digest(torch.load(tmp_path / "final.pt", weights_only=True)) == final
    events = job.events()
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [15], loaded
    assert not [e for e in events if e["event"] == "checkpoint_saved" and e["step"] == 20
                and e["time"] < loaded[0]["time"]]
    assert rows["leftovers"] == []
    assert [r["step"] for r in rows["checkpoints"]] == list(range(45, 0, -5))
    for row in rows["checkpoints"]:
        assert row["valid"] and row["model_digest"] == tiny_dropout_reference[row["step"]], row


def test_the_endpoint_down_during_a_save_training_goes_on(
        tiny_dropout_reference: dict[int, str], tmp_path: Path, aws: None) -> None:
    server = S3Server.start()
    try:
        server.make_bucket("outage")
        url, local = "s3://outage/job", tmp_path / "local"
        opts = s3_args(server, url, local, "--storage-opt", "read_timeout=1",
                       "--storage-opt", "connect_timeout=1", "--storage-opt", "max_attempts=1")
        job = harness.elastic_run(tmp_path / "run", [*EXACT_JOB, *opts],
                                  env=harness.job_env(server.env()))
        job.run_dir = local_root(server, url, local)
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved" and e["step"] == 10,
                           TIMEOUT)
        server.freeze()
        failed = job.wait_for_event(lambda e: e["event"] == "checkpoint_failed", TIMEOUT)
        server.thaw()
        assert job.wait(TIMEOUT) == 0, job.report()
        rows = listing(server, url)
        events = gathered_events(server, url, tmp_path)
    finally:
        server.stop()
    assert failed["policy"] == "continue"
    assert f"object store {server.endpoint} is not reachable" in failed["error"], failed
    # The agent uploaded every payload (its line is the store's), the worker committed.
    assert {e["uploaded_by"] for e in events if e["event"] == "checkpoint_saved"} == {"agent"}
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps == list(range(1, harness.TINY_DROPOUT_STEPS + 1))  # no step lost or redone
    saved = {r["step"] for r in rows["checkpoints"]}
    assert failed["step"] not in saved and harness.TINY_DROPOUT_STEPS in saved
    for row in rows["checkpoints"]:
        assert row["valid"] and row["model_digest"] == tiny_dropout_reference[row["step"]], row


# Extended (make test-extended); the default suite proves it with
# test_two_hosts_with_no_shared_path_restore_from_the_agents_memory, and
# test_fsdp_two_nodes_one_lost_then_one_joining_reshard_in_place in test_sharded_jobs.py.
@pytest.mark.extended
def test_a_resize_through_the_object_store_uses_each_sample_once(
        s3_bucket: tuple[S3Server, str], tmp_path: Path, aws: None) -> None:
    server, bucket = s3_bucket
    url, env = f"s3://{bucket}/resize", harness.job_env(server.env())
    first = [*SAMPLED_JOB, "--steps", "20", "--nproc-per-node", "2"]
    job = harness.elastic_run(tmp_path / "a", [*first, *s3_args(server, url, tmp_path / "n1")],
                              env=env)
    assert job.wait(TIMEOUT) == 0, job.report()
    second = [*SAMPLED_JOB, "--nproc-per-node", "3"]
    job = harness.elastic_run(tmp_path / "b", [*second, *s3_args(server, url, tmp_path / "n2")],
                              env=env)
    assert job.wait(TIMEOUT) == 0, job.report()
    samples = RunDir(url, StorageConfig(endpoint_url=server.endpoint,
                                        local_dir=str(tmp_path / "reader"))).gathered_samples()
    assert sorted(p.name for p in samples.glob("*.jsonl")) == [
        "rank-0.jsonl", "rank-1.jsonl", "rank-2.jsonl"]
    assert_each_sample_once(samples.parent)
    loaded = [e for e in gathered_events(server, url, tmp_path) if e["event"] ==
              "checkpoint_loaded"]
    assert [(e["step"], e["saved_world_size"], e["world_size"]) for e in loaded] == \
        [(20, 2, 3)]


def _launch_line(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "elastic_train", "run", "--steps", "3",
                           "--preset", "tiny", "--metrics-port", "0", *args],
                          env=harness.job_env(env), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    return proc.returncode, "\n".join(lines)


def test_bad_object_store_input_is_one_line_each_and_deletes_nothing(
        s3_bucket: tuple[S3Server, str], tmp_path: Path, aws: None) -> None:
    server, bucket = s3_bucket
    env = server.env()
    code, line = _launch_line(["--run-dir", "s3://no-such-bucket/x"], env, tmp_path)
    assert code == 2 and line == (
        f"elastic-train: error: run directory s3://no-such-bucket/x: bucket no-such-bucket "
        f"does not exist at {server.endpoint} (writing s3://no-such-bucket/x/.write-probe-"
        + line.split(".write-probe-")[1]), line
    assert line.endswith("): create it, or fix the bucket in --run-dir")

    down = f"http://127.0.0.1:{harness.free_ports()}"
    code, line = _launch_line(["--run-dir", f"s3://{bucket}/x", "--storage-opt",
                               f"endpoint_url={down}", "--storage-opt", "max_attempts=1"],
                              env, tmp_path)
    assert code == 1 and line.startswith(
        f"elastic-train: error: run directory s3://{bucket}/x: object store {down} is not "
        "reachable (writing "), line
    assert line.endswith("check that it is up and that --storage-opt endpoint_url / "
                         "AWS_ENDPOINT_URL names it"), line

    strict = S3Server.start(authenticate=True)
    try:
        code, line = _launch_line(["--run-dir", "s3://any/x"], strict.env(), tmp_path)
    finally:
        strict.stop()
    assert code == 2 and "refused the credentials for s3://any/x/.write-probe-" in line, line
    assert line.endswith("(InvalidAccessKeyId, writing): check AWS_ACCESS_KEY_ID / "
                         "AWS_SECRET_ACCESS_KEY / AWS_PROFILE and the bucket's policy"), line

    # A foreign object under the prefix where a checkpoint would be: said, kept.
    client = server.client()
    client.put_object(Bucket=bucket, Key="run/checkpoints/step-00000007/manifest.json",
                      Body=b"{}")
    client.put_object(Bucket=bucket, Key="run/checkpoints/step-00000007/state-notours.pt",
                      Body=b"x")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["checkpoints", "verify", f"s3://{bucket}/run", "--storage-opt",
                         f"endpoint_url={server.endpoint}"])
    assert code == 1
    assert out.getvalue() == (f"s3://{bucket}/run/checkpoints/step-00000007: CORRUPT: "
                              "manifest.json is not an elastic_train manifest\n")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {"run/checkpoints/step-00000007/manifest.json",
                    "run/checkpoints/step-00000007/state-notours.pt"}


def test_two_hosts_with_no_shared_path_restore_from_the_agents_memory(
        netbed: Any, tiny_dropout_reference: dict[int, str], tmp_path: Path, aws: None
) -> None:
    """Two nodes on hosts of their own (tests/netbed.py), the object store on a third, each
    node's local directory its own. Every checkpoint is held in two agents' memory (one per
    host); every worker of both hosts is SIGKILLed (the agents live on): the restart
    restores from the agents' memory, not from the object store, and the job ends with the
    weights of a run never killed, bit for bit."""
    from tests.integration import hosts
    from tests.integration.test_across_hosts import writer_of

    bed = netbed(["node-a", "node-b", "storage"], etcd=True)
    server = S3Server.start_on(bed.host("storage"))
    server.make_bucket("job")
    url = "s3://job/run"
    locals_ = {name: tmp_path / f"{name}-local" for name in ("node-a", "node-b")}
    nodes = [hosts.start_node(
        bed.host(name), tmp_path / "logs" / "run",
        [*hosts.etcd_v3(bed, bed.host(name), "memory", nnodes="2"), *EXACT_JOB,
         "--metrics-port", "0", *s3_args(server, url, local)], name=name, env=server.env(),
        script=True) for name, local in locals_.items()]
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(0 in harness.workers_of(n.proc.pid) for n in nodes):
            assert time.monotonic() < deadline, hosts.report(nodes)
            time.sleep(0.1)
        writer = writer_of(nodes)
        assert writer.host is not None
        writer.run_dir = local_root(server, url, locals_[writer.host.name])
        saved = writer.wait_for_event(
            lambda e: e["event"] == "checkpoint_saved" and e["step"] >= 15, TIMEOUT)
        for node in nodes:
            for pid in harness.workers_of(node.proc.pid).values():
                os.kill(pid, signal.SIGKILL)
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
        rows = server.call(lambda: listing(server, url))
        events = server.call(lambda: gathered_events(server, url, tmp_path))
    finally:
        for node in nodes:
            node.stop()
    assert saved["memory_copies"] == 2 and saved["uploaded_by"] == "agent", saved
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["source"], e["step"] >= saved["step"]) for e in loaded] == [("memory", True)], \
        loaded
    assert [r["step"] for r in rows["checkpoints"]] == list(range(45, 0, -5))
    for row in rows["checkpoints"]:
        assert row["valid"] and row["model_digest"] == tiny_dropout_reference[row["step"]], row
    for local in locals_.values():  # logs only: no checkpoint on any node's own disk
        assert not [p for p in local.rglob("*") if p.name.startswith("step-")]
    nodes_uploaded = {k.split("/")[2] for k in server.call(
        lambda: [o["Key"] for o in server.client().list_objects_v2(
            Bucket="job", Prefix="run/nodes/")["Contents"]])}
    assert len(nodes_uploaded) >= 1


def test_a_hand_written_loop_checkpoints_to_the_object_store(
        s3_bucket: tuple[S3Server, str], tmp_path: Path, aws: None) -> None:
    """The README's ElasticSession tutorial, unmodified, given ``s3://`` as its run dir:
    the endpoint and keys come from AWS_* variables alone (boto3's chain)."""
    server, bucket = s3_bucket
    url = f"s3://{bucket}/tutorial"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            str(harness.REPO / "examples" / "ddp_tutorial_elastic.py"), url]
    env = harness.job_env({**server.env(), "ELASTIC_TRAIN_LOCAL_DIR": str(tmp_path / "local")})
    job = harness.start(argv, tmp_path / "run", env)
    assert job.wait(TIMEOUT) == 0, job.report()
    rows = listing(server, url)
    assert rows["checkpoints"] and all(r["valid"] for r in rows["checkpoints"]), rows
    events = gathered_events(server, url, tmp_path)
    assert [e["event"] for e in events][-1] == "end"
