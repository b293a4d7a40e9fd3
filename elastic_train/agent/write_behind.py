"""The object store written behind the memory tier: the agent uploads the payloads its
holder keeps, so that a worker's training process never runs the S3 client's bulk work.

With an ``s3://`` run directory, rank 0's checkpoint manager offers each serialized
snapshot to its agent's holder (agent/snapshot_holder.py), then asks the holder to upload
those same bytes to the payload's key (``POST UPLOAD_PATH``, live/memory_tier.py), and
writes the manifest itself once the holder says they are in. The commit (manifest last,
the writer fence just before it), retention and the events stay the worker's; what moves
out of the training process is boto3's multipart upload: its threads, signing and
checksums, which held the GIL against the training thread (a checkpoint's stall on
``s3://`` was 3.5 to 5 times a local run directory's, benchmarks/object_store.py). Here
they run in another process, on a thread at idle priority like the local writer's.

Credentials are this agent's own (its environment, the AWS config files, a pod identity):
the worker's client options travel with the request (``ObjectStore.client_options``), a
secret never does. Only bytes the holder keeps (their sha256 checked when they arrived)
are written, and only to a checkpoint payload's key (``PAYLOAD_KEY``). boto3 is imported
at the first upload, never before the workers' server starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_train.checkpoint.object_keys import PAYLOAD_KEY
from elastic_train.checkpoint.object_store import ObjectStore
from elastic_train.errors import ConfigError, StorageRefusedError, StorageUnavailableError

__all__ = ["PayloadUploads", "UploadFailed"]

log = logging.getLogger(__name__)


class UploadFailed(Exception):
    """The store (or this agent's client for it) refused or did not answer: ``kind`` is
    live/memory_tier.py's (``refused``, ``unavailable``, ``config``), the line the worker
    reports."""

    def __init__(self, kind: str, line: str) -> None:
        super().__init__(line)
        self.kind = kind


_KINDS: tuple[tuple[type[Exception], str], ...] = (
    (StorageRefusedError, "refused"), (StorageUnavailableError, "unavailable"),
    (ConfigError, "config"))


class PayloadUploads:
    """This agent's uploads of held payloads: one client per store and client options
    (made at the first upload to it, kept for the next)."""

    def __init__(self) -> None:
        self._stores: dict[str, ObjectStore] = {}
        self._lock = threading.Lock()

    def upload(self, payload: bytearray, url: str, client_options: Mapping[str, Any]) -> float:
        """Upload ``payload`` to the object ``url``; the seconds it took.

        Raises ``ValueError`` (a URL that is not a checkpoint payload's, unusable options)
        or ``UploadFailed`` (the store's answer, one line)."""
        try:
            store, key = ObjectStore.for_url(url, client_options)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if not PAYLOAD_KEY.search(key):
            raise ValueError(f"{url} is not a checkpoint payload's key: a holder writes "
                             "nothing else")
        store = self._shared(store)
        started = time.monotonic()
        try:
            store.upload(key, payload)
        except Exception as exc:
            kind = next((k for cls, k in _KINDS if isinstance(exc, cls)), None)
            if kind is None:
                raise
            raise UploadFailed(kind, str(exc)) from None
        finally:
            _release_free_memory()
        seconds = time.monotonic() - started
        log.debug("memory tier: uploaded %s (%d bytes) in %.3fs", url, len(payload), seconds)
        return seconds

    def _shared(self, store: ObjectStore) -> ObjectStore:
        """The store already made for the same bucket and options (its client reused)."""
        name = repr((store.location.bucket, sorted(store.client_options().items())))
        with self._lock:
            return self._stores.setdefault(name, store)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ldconfig); None
    where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def _release_free_memory() -> None:
    """Hand the upload's freed part buffers back to the system (glibc keeps what its
    threads' arenas freed; an agent holds one checkpoint and should cost about that)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
