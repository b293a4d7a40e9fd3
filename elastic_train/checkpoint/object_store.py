"""The one module that talks to an object store (the S3 API), through boto3.

Why boto3: it is the reference client of the S3 API, synchronous (no event loop thread in a
worker that forks), and it gives the two things a checkpoint store needs beyond get and put:
multipart uploads that are invisible until completed (a torn upload never shows as an
object) and conditional writes (``If-None-Match: *``, the writer fence's ``O_EXCL``).
s3fs would add an asyncio layer over the same botocore; s3torchconnector needs AWS's CRT and
speaks only to DCP's readers and writers.

Where the endpoint, region and credentials come from is boto3's own chain: ``AWS_*``
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...), the shared
config and credentials files, instance and pod identities; ``StorageConfig`` (the job's
``[storage]`` table, ``--storage-opt KEY=VALUE``) overrides endpoint, region, profile and
addressing, never credentials. A custom endpoint (an S3-compatible server) gets path-style
addressing unless told otherwise.

Every failure leaves this module as one of our errors, with one line that names the
endpoint or bucket and the fix: ``StorageUnavailableError`` (no answer), ``StorageRefusedError``
(credentials, permissions, a missing bucket).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from elastic_train.config import StorageConfig
from elastic_train.errors import ConfigError, StorageRefusedError, StorageUnavailableError

SCHEME = "s3://"
MULTIPART_THRESHOLD = 64 << 20
"""Payloads larger than this are uploaded in parts (in parallel), committed only whole."""


def is_object_url(location: object) -> bool:
    """Whether a run directory names an object store (``s3://bucket/prefix``)."""
    return isinstance(location, str) and "://" in location


@dataclass(frozen=True)
class ObjectLocation:
    """A bucket and a key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        """``s3://bucket/some/prefix`` -> (bucket, "some/prefix"); other schemes are refused."""
        if not url.startswith(SCHEME):
            scheme = url.split("://", 1)[0]
            raise ConfigError(
                f"run directory {url}: {scheme}:// is not supported; use a local path or "
                "s3://BUCKET/PREFIX (GCS, Azure and others through their S3-compatible "
                "endpoint: --storage-opt endpoint_url=...)")
        rest = url[len(SCHEME):]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ConfigError(f"run directory {url} names no bucket: use s3://BUCKET/PREFIX")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        """The key of ``parts`` under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url(self, *parts: str) -> str:
        return f"{SCHEME}{self.bucket}/{self.key(*parts)}".rstrip("/")


CLIENT_OPTIONS = ("endpoint_url", "region", "profile", "addressing_style", "connect_timeout",
                  "read_timeout", "max_attempts")
"""The ``StorageConfig`` fields that shape a client: what another process (the agent that
uploads behind the memory tier, agent/write_behind.py) needs to reach a store as this one
does. Never credentials: those come from that process's own chain."""


class BytesReader(io.RawIOBase):
    """A seekable file object over bytes already in memory, without copying them whole
    (``io.BytesIO`` of a memoryview or bytearray copies): what an upload reads from."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = max(0, min(len(target), len(self._view) - self._pos))
        target[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


@dataclass(frozen=True)
class Listed:
    """One object of a listing."""

    key: str
    size: int


class ObjectStore:
    """A bucket and prefix, and a client for them (made on first use)."""

    def __init__(self, location: ObjectLocation, options: StorageConfig | None = None) -> None:
        self.location = location
        self.options = options or StorageConfig()
        self._client: Any = None
        self._pid = -1

    @classmethod
    def for_url(cls, url: str, client_options: Mapping[str, Any]) -> tuple[ObjectStore, str]:
        """``(store, key)`` for one object's URL, reached with another process's
        ``client_options()``. Raises ``ValueError`` naming what is wrong with them."""
        location = ObjectLocation.parse(url)
        unknown = sorted(set(client_options) - set(CLIENT_OPTIONS))
        if unknown:
            raise ValueError(f"unknown storage options {', '.join(unknown)}")
        for name, value in client_options.items():
            numeric = name in ("connect_timeout", "read_timeout", "max_attempts")
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float) if numeric else str)):
                raise ValueError(f"storage option {name} is not a "
                                 f"{'number' if numeric else 'string'}")
        options = StorageConfig(**{k: v for k, v in client_options.items() if v is not None})
        return cls(ObjectLocation(location.bucket, ""), options), location.prefix

    def client_options(self) -> dict[str, Any]:
        """What another process needs to reach this store as this one does (``for_url``):
        the client's options, the endpoint as this process resolves it."""
        options = {name: getattr(self.options, name) for name in CLIENT_OPTIONS}
        if self.endpoint != "AWS S3":
            options["endpoint_url"] = self.endpoint
        return options

    # ---- the client ----------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The endpoint as the user set it (option, else AWS_ENDPOINT_URL*), else AWS's."""
        return (self.options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3")

    @property
    def client(self) -> Any:
        """A boto3 S3 client; a forked child makes its own (clients are not fork-safe)."""
        if self._client is None or self._pid != os.getpid():
            self._client = self._make_client()
            self._pid = os.getpid()
        return self._client

    def _make_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ConfigError("an s3:// run directory needs boto3: pip install "
                              "'elastic-train[s3]' (or pip install boto3)") from None
        opts = self.options
        custom = self.endpoint != "AWS S3"
        style = opts.addressing_style or ("path" if custom else "auto")
        config = Config(
            s3={"addressing_style": style},
            connect_timeout=opts.connect_timeout, read_timeout=opts.read_timeout,
            retries={"max_attempts": opts.max_attempts, "mode": "standard"},
            max_pool_connections=16,
            # botocore >= 1.36 sends CRC checksums with every upload by default, which many
            # S3-compatible servers refuse (GCS, R2, older MinIO, OVH: boto/boto3#4392);
            # a custom endpoint gets them only where an operation requires them. The
            # manifest's sha256, checked at every verify and load, covers the bytes anyway.
            **({"request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required"} if custom else {}))
        session = boto3.session.Session(profile_name=opts.profile) if opts.profile \
            else boto3.session.Session()
        kwargs: dict[str, Any] = {"config": config}
        if opts.endpoint_url:
            kwargs["endpoint_url"] = opts.endpoint_url
        if opts.region:
            kwargs["region_name"] = opts.region
        elif session.region_name is None:
            kwargs["region_name"] = "us-east-1"  # S3-compatible servers ignore it
        return session.client("s3", **kwargs)

    def _failure(self, exc: BaseException, doing: str, key: str | None = None
                 ) -> Exception:
        """Our error for a botocore one: one line naming the endpoint or bucket and the fix."""
        from botocore import exceptions as bce

        where = f"s3://{self.location.bucket}/{key.rstrip('/')}" if key else \
            self.location.url()
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchBucket",) or (code == "404" and key is None):
                what = f"{doing} {where}" if key else doing
                return StorageRefusedError(
                    f"bucket {self.location.bucket} does not exist at {self.endpoint} "
                    f"({what}): create it, or fix the bucket in --run-dir")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                        "InvalidToken", "ExpiredToken", "AllAccessDisabled") or status == 403:
                return StorageRefusedError(
                    f"{self.endpoint} refused the credentials for {where} ({code or status}, "
                    f"{doing}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE "
                    "and the bucket's policy")
            return StorageRefusedError(f"{self.endpoint} answered {code or status} to "
                                       f"{doing} {where}: {err.get('Message', exc)}")
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return StorageRefusedError(
                f"no credentials for {where} ({doing}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a pod identity")
        if isinstance(exc, bce.ProfileNotFound):
            return ConfigError(f"storage profile {self.options.profile!r} is not in the AWS "
                               "config files: fix --storage-opt profile=...")
        if isinstance(exc, bce.BotoCoreError | OSError):
            return StorageUnavailableError(
                f"object store {self.endpoint} is not reachable ({doing} {where}: "
                f"{type(exc).__name__}): check that it is up and that --storage-opt "
                "endpoint_url / AWS_ENDPOINT_URL names it")
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))

    def _call(self, doing: str, key: str | None, fn: Any, /, **kwargs: Any) -> Any:
        from botocore import exceptions as bce

        try:
            return fn(**kwargs)
        except (bce.BotoCoreError, bce.ClientError, OSError) as exc:
            raise self._failure(exc, doing, key) from exc

    # ---- operations ----------------------------------------------------------------------
    def check_bucket(self) -> None:
        """Raise our error when the bucket is missing, refused or unreachable."""
        self._call("checking the bucket", None, self.client.head_bucket,
                   Bucket=self.location.bucket)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write one object in one request. With ``if_absent``: only if no object has that
        key (a conditional write); False when one had."""
        from botocore import exceptions as bce

        kwargs: dict[str, Any] = {"Bucket": self.location.bucket, "Key": key, "Body": data}
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            self.client.put_object(**kwargs)
        except bce.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if if_absent and status in (409, 412):
                return False
            raise self._failure(exc, "writing", key) from exc
        except (bce.BotoCoreError, OSError) as exc:
            raise self._failure(exc, "writing", key) from exc
        return True

    def upload(self, key: str, data: IO[bytes] | bytes | bytearray | memoryview) -> None:
        """Write one object from a file object or bytes in memory; large ones in parts,
        visible only once every part is in (a crash leaves an incomplete upload, never a
        partial object)."""
        from boto3.s3.transfer import TransferConfig

        if isinstance(data, bytes | bytearray | memoryview):
            data = BytesReader(data)
        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD,
                                multipart_chunksize=MULTIPART_THRESHOLD // 2,
                                max_concurrency=4, use_threads=True)
        self._call("uploading", key, self.client.upload_fileobj, Fileobj=data,
                   Bucket=self.location.bucket, Key=key, Config=config)

    def get(self, key: str) -> bytes | None:
        """One object's bytes; None when there is no such object."""
        from botocore import exceptions as bce

        try:
            answer = self.client.get_object(Bucket=self.location.bucket, Key=key)
            return answer["Body"].read()
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._failure(exc, "reading", key) from exc
        except (bce.BotoCoreError, OSError) as exc:
            raise self._failure(exc, "reading", key) from exc

    def chunks(self, key: str, size: int = 8 << 20) -> Iterator[bytes]:
        """One object's bytes in chunks (streamed: verifying never holds it whole)."""
        from botocore import exceptions as bce

        answer = self._call("reading", key, self.client.get_object,
                            Bucket=self.location.bucket, Key=key)
        body = answer["Body"]
        try:
            while chunk := body.read(size):
                yield chunk
        except (bce.BotoCoreError, OSError) as exc:
            raise self._failure(exc, "reading", key) from exc
        finally:
            body.close()

    def download(self, key: str) -> io.BytesIO:
        """One object's bytes in memory (in parallel ranges when large)."""
        from boto3.s3.transfer import TransferConfig

        out = io.BytesIO()
        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD,
                                multipart_chunksize=MULTIPART_THRESHOLD // 2, max_concurrency=4)
        self._call("reading", key, self.client.download_fileobj, Bucket=self.location.bucket,
                   Key=key, Fileobj=out, Config=config)
        out.seek(0)
        return out

    def list(self, prefix: str) -> list[Listed]:
        """Every object whose key starts with ``prefix`` (all pages)."""
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call("listing", prefix, paginator.paginate, Bucket=self.location.bucket,
                           Prefix=prefix)
        from botocore import exceptions as bce

        try:
            for page in pages:
                found.extend(Listed(o["Key"], int(o["Size"])) for o in page.get("Contents", ()))
        except (bce.BotoCoreError, bce.ClientError, OSError) as exc:
            raise self._failure(exc, "listing", prefix) from exc
        return found

    def delete(self, keys: list[str]) -> None:
        """Delete objects (a missing one is no error)."""
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self._call("deleting", keys[start], self.client.delete_objects,
                       Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True})

    def copy(self, source: str, target: str) -> None:
        """A server-side copy (no bytes through this host)."""
        self._call("copying", source, self.client.copy,
                   CopySource={"Bucket": self.location.bucket, "Key": source},
                   Bucket=self.location.bucket, Key=target)

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        """(key, upload id) of multipart uploads started under ``prefix`` and never completed."""
        answer = self._call("listing uploads", prefix, self.client.list_multipart_uploads,
                            Bucket=self.location.bucket, Prefix=prefix)
        return [(u["Key"], u["UploadId"]) for u in answer.get("Uploads", ())]

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._call("aborting an upload", key, self.client.abort_multipart_upload,
                   Bucket=self.location.bucket, Key=key, UploadId=upload_id)
