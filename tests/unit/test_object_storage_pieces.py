"""The pure pieces of s3:// run directories: URLs, options, local directories, merged logs,
and the one line each storage failure becomes (the real server: tests/integration)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from botocore import exceptions as bce

from elastic_train.checkpoint.object_store import BytesReader, ObjectLocation, ObjectStore
from elastic_train.config import StorageConfig, run_location
from elastic_train.config_options import parse_job_args, storage_from_options
from elastic_train.errors import ConfigError, StorageRefusedError, StorageUnavailableError
from elastic_train.rundir import RunDir, _parts, _write_merged


def test_only_s3_urls_are_run_directories() -> None:
    assert ObjectLocation.parse("s3://bucket/a/b/") == ObjectLocation("bucket", "a/b")
    assert ObjectLocation.parse("s3://bucket") == ObjectLocation("bucket", "")
    assert ObjectLocation("bucket", "a").key("checkpoints", "x") == "a/checkpoints/x"
    assert ObjectLocation("bucket", "").key("writers") == "writers"
    with pytest.raises(ConfigError) as caught:
        RunDir("gs://bucket/x")
    assert str(caught.value) == (
        "run directory gs://bucket/x: gs:// is not supported; use a local path or "
        "s3://BUCKET/PREFIX (GCS, Azure and others through their S3-compatible endpoint: "
        "--storage-opt endpoint_url=...)")
    with pytest.raises(ConfigError, match="names no bucket"):
        ObjectLocation.parse("s3:///x")


def test_a_url_stays_text_and_a_path_a_path() -> None:
    assert run_location("s3://b//x") == "s3://b//x"
    assert run_location("runs/a") == Path("runs/a")
    config = parse_job_args(["--run-dir", "s3://b/p", "--storage-opt", "region=eu-west-1"])
    assert config.run_dir == "s3://b/p" and config.storage.region == "eu-west-1"
    assert config.to_dict()["run_dir"] == "s3://b/p"


def test_storage_options_refuse_credentials_and_bad_values() -> None:
    with pytest.raises(ConfigError) as caught:
        storage_from_options(["aws_secret_access_key=x"])
    assert str(caught.value) == (
        "--storage-opt aws_secret_access_key: unknown key; the keys are endpoint_url, region, "
        "profile, addressing_style, local_dir, connect_timeout, read_timeout, max_attempts, "
        "publish_seconds (credentials come from AWS_* variables or profiles, never options)")
    with pytest.raises(ConfigError, match=r"--storage-opt read_timeout='soon' is invalid: "
                                          r"expected a float"):
        storage_from_options(["read_timeout=soon"])
    with pytest.raises(ConfigError, match="addressing_style='dns' is invalid: use path, "
                                          "virtual or auto"):
        storage_from_options(["addressing_style=dns"])
    with pytest.raises(ConfigError, match="write it as KEY=VALUE"):
        storage_from_options(["endpoint_url"])
    options = storage_from_options(["max_attempts=1", "endpoint_url=http://h:9"],
                                   {"region": "r"})
    assert (options.max_attempts, options.endpoint_url, options.region) == (1, "http://h:9", "r")


def test_each_run_has_its_own_local_directory_and_a_node_its_own_name(tmp_path: Path) -> None:
    storage = StorageConfig(local_dir=str(tmp_path))
    a, b = RunDir("s3://bkt/run/a", storage), RunDir("s3://bkt/run_a", storage)
    assert a.root != b.root and a.root.parent == tmp_path == b.root.parent
    assert a.remote and not RunDir(tmp_path).remote
    assert a.events.parent == a.root and a.checkpoints == "s3://bkt/run/a/checkpoints"
    first = a.node_id()
    assert first == RunDir("s3://bkt/run/a", storage).node_id()  # the node's incarnations
    assert first != RunDir("s3://bkt/run/a", StorageConfig(local_dir=str(tmp_path / "other"))
                           ).node_id()  # another node (another local directory)


def test_merged_logs_are_in_time_order_and_drop_torn_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"time": 3, "n": "c"}), json.dumps({"time": 1, "n": "a"}),
             '{"time": 2, "n": "torn', json.dumps({"time": 2, "n": "b"})]
    _write_merged(tmp_path / "out.jsonl", lines)
    merged = [json.loads(line)["n"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert merged == ["a", "b", "c"]


def _store() -> ObjectStore:
    return ObjectStore(ObjectLocation("bkt", "run"), StorageConfig(endpoint_url="http://s3:9"))


def _client_error(code: str, status: int) -> bce.ClientError:
    return bce.ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_each_failure_is_one_line_naming_the_endpoint_or_bucket() -> None:
    store = _store()
    missing = store._failure(_client_error("NoSuchBucket", 404), "writing", "run/x")
    assert isinstance(missing, StorageRefusedError) and str(missing) == (
        "bucket bkt does not exist at http://s3:9 (writing s3://bkt/run/x): create it, or fix "
        "the bucket in --run-dir")
    refused = store._failure(_client_error("SignatureDoesNotMatch", 403), "reading", "run/y")
    assert str(refused) == (
        "http://s3:9 refused the credentials for s3://bkt/run/y (SignatureDoesNotMatch, "
        "reading): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE and the "
        "bucket's policy")
    down = store._failure(bce.EndpointConnectionError(endpoint_url="http://s3:9"), "listing",
                          "run/checkpoints/")
    assert isinstance(down, StorageUnavailableError) and str(down) == (
        "object store http://s3:9 is not reachable (listing s3://bkt/run/checkpoints: "
        "EndpointConnectionError): check that it is up and that --storage-opt endpoint_url / "
        "AWS_ENDPOINT_URL names it")
    assert missing.exit_code == refused.exit_code == 2 and down.exit_code == 1


def test_a_growing_log_is_cut_where_it_was_cut_before() -> None:
    lines = [json.dumps({"time": i, "pad": "x" * (i % 7)}).encode() + b"\n" for i in range(300)]
    data = b"".join(lines)
    earlier = _parts(data[:3000], size=500)
    later = _parts(data, size=500)
    assert b"".join(later) == data and b"".join(earlier) == data[:3000]
    assert later[:len(earlier) - 1] == earlier[:-1]  # complete parts never change
    assert all(len(p) >= 500 and p.endswith(b"\n") for p in later[:-1])
    assert _parts(b"", size=500) == [b""] and _parts(b"no line end" * 100, size=5) == [
        b"no line end" * 100]


def test_a_custom_endpoint_gets_checksums_only_where_required_and_aws_its_defaults() -> None:
    """botocore >= 1.36 adds CRC checksums to every upload, which GCS, R2 and older MinIO
    refuse (boto/boto3#4392): a custom endpoint is spared them; AWS keeps them."""
    custom = ObjectStore(ObjectLocation("b", ""), StorageConfig(endpoint_url="http://s3.local"))
    aws = ObjectStore(ObjectLocation("b", ""), StorageConfig(region="eu-west-1"))
    assert custom.client.meta.config.request_checksum_calculation == "when_required"
    assert custom.client.meta.config.response_checksum_validation == "when_required"
    assert aws.client.meta.config.request_checksum_calculation == "when_supported"


def test_another_process_reaches_the_store_with_its_client_options_and_no_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.local:9000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hush")
    mine = ObjectStore(ObjectLocation("b", "p"), StorageConfig(read_timeout=3.0))
    options = mine.client_options()
    assert options["endpoint_url"] == "http://s3.local:9000" and options["read_timeout"] == 3.0
    assert "hush" not in repr(options) and "local_dir" not in options
    theirs, key = ObjectStore.for_url("s3://b/p/checkpoints/step-00000001/state-0.pt", options)
    assert key == "p/checkpoints/step-00000001/state-0.pt"
    assert theirs.client_options() == options
    with pytest.raises(ValueError, match="unknown storage options aws_secret_access_key"):
        ObjectStore.for_url("s3://b/k", {"aws_secret_access_key": "x"})
    with pytest.raises(ValueError, match="storage option read_timeout is not a number"):
        ObjectStore.for_url("s3://b/k", {"read_timeout": "3"})


def test_an_upload_reads_bytes_in_memory_without_copying_them_whole() -> None:
    data = bytearray(range(256)) * 4
    reader = BytesReader(memoryview(data))
    assert reader.read(10) == bytes(data[:10]) and reader.tell() == 10
    assert reader.seek(-6, io.SEEK_END) == len(data) - 6 and reader.read() == bytes(data[-6:])
    assert reader.read(5) == b"" and reader.seek(0) == 0 and reader.read() == bytes(data)
