"""What the etcd-v3 rendezvous needs of a key-value store: the ``KV`` contract (client.py's
``EtcdKV`` implements it on a real etcd; tests/memory_kv.py in memory, for unit tests), its
values, its watches and its errors. Torch-free but for torch's rendezvous error type."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

__all__ = ["KV", "EtcdUnreachableError", "KeyValue", "LeaseNotFound", "Watch", "WatchCompacted",
           "WatchEvent", "WatchQueue"]


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it; ``mod_revision`` changes on every write of the key.

    ``create_revision`` is 0 when unknown (what a successful swap returns).
    """

    key: str
    value: bytes
    mod_revision: int
    create_revision: int


class EtcdUnreachableError(RendezvousConnectionError):
    """No answer from etcd at all (refused, reset, timed out): worth retrying, unlike a
    refusal by etcd itself (credentials, TLS, a missing API).

    ``waited`` is how long it was retried (None: not yet), and goes into the message.
    """

    def __init__(self, endpoint: str, detail: str, waited: float | None = None) -> None:
        self.endpoint = endpoint
        self.detail = detail
        self.waited = waited
        if waited is None:
            message = (f"cannot reach etcd at {endpoint} ({detail}): check that etcd runs "
                       "there and --rdzv-endpoint")
        else:
            message = (f"cannot reach etcd at {endpoint} for {waited:g} s ({detail}): check "
                       "that etcd runs there and --rdzv-endpoint, or wait longer with "
                       "--rdzv-conf connect_timeout=SECONDS")
        super().__init__(message)


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix."""

    kind: str  # "put" or "delete"
    key: str
    value: bytes  # b"" for a delete
    mod_revision: int  # the revision of this change
    create_revision: int  # of the key (0 for a delete)


class WatchCompacted(Exception):
    """The watch's start revision was compacted away: re-read, then watch again."""

    def __init__(self, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(f"etcd compacted the revisions before {compact_revision} that the "
                         "watch started from: re-read, then watch again")


class Watch(Protocol):
    """A stream of the changes under a key prefix (``KV.watch_prefix``)."""

    def next(self, timeout: float) -> list[WatchEvent]:
        """The events that arrived (in revision order), waiting up to ``timeout`` seconds for
        the first; [] when none came. Raises EtcdUnreachableError when the stream broke
        (etcd down or restarted) and WatchCompacted when the start revision is gone; after
        either, the watch is dead (the caller re-reads and watches again)."""
        ...

    def cancel(self) -> None:
        """Stop the watch (idempotent; makes a blocked next() return [] soon)."""
        ...


class LeaseNotFound(Exception):
    """A write named a lease that expired or was revoked; grant a new one and retry."""


class KV(Protocol):
    """The key-value operations the rendezvous needs (a real etcd or a fake)."""

    endpoint: str

    def get(self, key: str) -> KeyValue | None: ...

    def get_many(self, keys: Sequence[str]) -> dict[str, KeyValue]: ...

    def count_prefix(self, prefix: str) -> int: ...

    def put(self, key: str, value: bytes, lease: int = 0) -> None: ...

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None: ...

    def swap(self, key: str, value: bytes, revision: int, lease: int = 0
             ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key's mod_revision is ``revision`` (0: the key is absent).

        Returns (True, the new key) or (False, the current key or None if absent).
        """
        ...

    def swap_value(self, key: str, value: bytes, expected: bytes | None, lease: int = 0
                   ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key holds ``expected`` (None: the key is absent)."""
        ...

    def delete(self, key: str) -> bool: ...

    def grant_lease(self, ttl: int) -> int: ...

    def version(self) -> str: ...

    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key, with mod_revision AND create_revision)
        and the store's revision at the read (a watch from revision + 1 misses nothing)."""
        ...

    def put_many_if_absent(self, guard: str, items: Sequence[tuple[str, bytes]],
                           lease: int = 0) -> bool:
        """One txn: if ``guard`` does not exist, put every item (guard usually among them);
        whether it did. len(items) <= MAX_TXN_OPS."""
        ...

    def put_and_claim(self, key: str, value: bytes, claim: str, claim_value: bytes,
                      prefix: str, lease: int = 0) -> tuple[bool, list[KeyValue], int]:
        """One txn: put ``key``, and create ``claim`` if it does not exist, else read every
        key under ``prefix``. (claimed, the keys read (none when claimed), the revision a
        watch of ``prefix`` continues from, minus one). Both puts carry ``lease``."""
        ...

    def keep_alive(self, lease: int) -> int:
        """Renew a lease once; its TTL in seconds now, 0 if etcd no longer knows it (expired
        or revoked)."""
        ...

    def revoke_lease(self, lease: int) -> None:
        """Revoke a lease (its keys go at once); no error if it is already gone."""
        ...

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        """Changes under ``prefix`` from ``start_revision`` on (inclusive)."""
        ...


_WAKE = object()  # put on a watch's queue by cancel(): wakes a blocked next()


class WatchQueue:
    """The consumer side of a watch: batches of events, or the error that ended the stream,
    put on a queue by a producer (the stream's reader thread, or a fake etcd)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._failure: BaseException | None = None
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called: the producer stops."""
        return self._cancelled

    # producer side
    def push(self, events: list[WatchEvent]) -> None:
        if events:
            self._queue.put(events)

    def fail(self, error: BaseException) -> None:
        self._queue.put(error)

    # Watch
    def next(self, timeout: float) -> list[WatchEvent]:
        if self._cancelled:
            return []
        if self._failure is not None:
            raise self._failure
        try:
            items = [self._queue.get(timeout=timeout) if timeout > 0
                     else self._queue.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        events: list[WatchEvent] = []
        for item in items:
            if isinstance(item, BaseException):
                self._failure = item  # nothing comes after it
                break
            if item is not _WAKE:
                events.extend(item)
        if self._cancelled:
            return []
        if self._failure is not None and not events:
            raise self._failure
        return events  # a failure behind them is raised by the next call

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._queue.put(_WAKE)
