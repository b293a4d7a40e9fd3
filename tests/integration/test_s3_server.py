"""The S3 test server of tests/s3_server.py: a real endpoint that stores and returns objects,
refuses a conditional put of an existing key as S3 does (412 PreconditionFailed, what an
atomic "create if absent" relies on), goes silent when frozen and answers again, with its
data, when thawed; reachable by a worker from its environment alone, and from the hosts of
the network test bed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from tests import netbed as netbed_module
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow

TIMEOUT = 1.0  # the short client's connect and read timeouts
TIMEOUT_BOUND = 5.0  # a frozen server's call must fail within this (one attempt, no retry)


@pytest.fixture
def own_server() -> Iterator[S3Server]:
    """A server of this test alone (the session's must never be frozen)."""
    server = S3Server.start()
    yield server
    server.stop()


def test_an_object_put_is_got_back(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    assert server.endpoint.startswith("http://127.0.0.1:")
    client = server.client()
    client.put_object(Bucket=bucket, Key="runs/a/step-1/model.pt", Body=b"\x00weights\xff")
    got = client.get_object(Bucket=bucket, Key="runs/a/step-1/model.pt")
    assert got["Body"].read() == b"\x00weights\xff"
    listed = client.list_objects_v2(Bucket=bucket, Prefix="runs/a/")
    assert [o["Key"] for o in listed["Contents"]] == ["runs/a/step-1/model.pt"]


def test_each_test_gets_a_bucket_of_its_own(s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    listed = server.client().list_objects_v2(Bucket=bucket)
    assert listed["KeyCount"] == 0


def test_a_conditional_put_of_an_existing_key_fails_with_412(
        s3_bucket: tuple[S3Server, str]) -> None:
    from botocore.exceptions import ClientError

    server, bucket = s3_bucket
    client = server.client()
    client.put_object(Bucket=bucket, Key="lock", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key="lock", Body=b"second", IfNoneMatch="*")
    error = caught.value.response
    assert error["Error"]["Code"] == "PreconditionFailed"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="lock")["Body"].read() == b"first"


def test_a_frozen_server_times_out_and_a_thawed_one_answers_with_its_data(
        own_server: S3Server) -> None:
    from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

    own_server.make_bucket("frozen")
    client = own_server.client(connect_timeout=TIMEOUT, read_timeout=TIMEOUT, max_attempts=1)
    client.put_object(Bucket="frozen", Key="kept", Body=b"data")

    own_server.freeze()
    try:
        assert not own_server.answers(timeout=TIMEOUT)
        started = time.monotonic()
        with pytest.raises((ReadTimeoutError, ConnectTimeoutError)):
            client.get_object(Bucket="frozen", Key="kept")
        elapsed = time.monotonic() - started
        assert TIMEOUT * 0.9 <= elapsed < TIMEOUT_BOUND, elapsed
    finally:
        own_server.thaw()

    assert own_server.answers(timeout=5.0)
    got = client.get_object(Bucket="frozen", Key="kept")
    assert got["Body"].read() == b"data"


def test_a_stopped_server_refuses_connections(own_server: S3Server) -> None:
    from botocore.exceptions import EndpointConnectionError

    client = own_server.client(connect_timeout=TIMEOUT, read_timeout=TIMEOUT, max_attempts=1)
    own_server.stop()
    assert own_server.proc.poll() is not None
    with pytest.raises(EndpointConnectionError):
        client.list_buckets()


def test_a_worker_reaches_the_server_from_its_environment_alone(
        s3_bucket: tuple[S3Server, str]) -> None:
    server, bucket = s3_bucket
    server.client().put_object(Bucket=bucket, Key="from-test", Body=b"hello")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env())
    script = ("import sys, boto3\n"
              "s3 = boto3.client('s3')\n"
              "body = s3.get_object(Bucket=sys.argv[1], Key='from-test')['Body'].read()\n"
              "s3.put_object(Bucket=sys.argv[1], Key='from-worker', Body=body[::-1])\n")
    done = subprocess.run([sys.executable, "-c", script, bucket], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    got = server.client().get_object(Bucket=bucket, Key="from-worker")
    assert got["Body"].read() == b"olleh"


def test_a_server_on_a_bed_host_serves_the_other_hosts(
        netbed: Callable[..., netbed_module.Netbed]) -> None:
    bed = netbed(("store", "node-a"))
    store, node = bed.host("store"), bed.host("node-a")
    server = S3Server.start_on(store)
    assert server.endpoint == f"http://{store.ip}:9000"
    client = server.client(connect_timeout=TIMEOUT, read_timeout=TIMEOUT, max_attempts=1)
    server.make_bucket("bed")
    node.call(lambda: client.put_object(Bucket="bed", Key="k", Body=b"across"))
    assert node.call(lambda: client.get_object(Bucket="bed", Key="k")["Body"].read()) \
        == b"across"
    # Frozen, it goes silent for the other hosts too; thawed, it answers with its data.
    server.freeze()
    assert not server.answers(timeout=TIMEOUT)
    server.thaw()
    assert node.call(lambda: client.get_object(Bucket="bed", Key="k")["Body"].read()) \
        == b"across"
    server.stop()
    assert server.proc.poll() is not None
