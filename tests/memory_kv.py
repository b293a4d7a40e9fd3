"""``MemoryKV``: an in-memory stand-in for etcd behind the ``KV`` protocol (tests only).

It keeps etcd's rules that the rendezvous relies on — one global revision incremented by
every write, a key's mod_revision and create_revision, revision 0 for an absent key,
leases that expire and take their keys with them, one revision per transaction, watches
that replay a full history of changes — on a clock the test advances. The
contract tests run the same assertions against it and against a real etcd, which is what
keeps the two honest.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from elastic_train.rendezvous.etcd_v3.gateway import MAX_TXN_OPS, chunks
from elastic_train.rendezvous.etcd_v3.kv import (
    EtcdUnreachableError,
    KeyValue,
    LeaseNotFound,
    Watch,
    WatchCompacted,
    WatchEvent,
    WatchQueue,
)


class _MemoryWatch(WatchQueue):
    """A watch on ``MemoryKV``: the store pushes its changes into the queue."""

    def __init__(self, kv: MemoryKV, prefix: str, start_revision: int) -> None:
        super().__init__()
        self._kv = kv
        self.prefix = prefix
        self.start_revision = start_revision

    def _offer(self, event: WatchEvent) -> None:
        if event.key.startswith(self.prefix) and event.mod_revision >= self.start_revision:
            self.push([event])

    def cancel(self) -> None:
        self._kv._unwatch(self)
        super().cancel()


class MemoryKV:
    """Thread-safe fake of ``elastic_train.rendezvous.etcd_v3.kv.KV``."""

    endpoint = "memory://fake-etcd"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, KeyValue] = {}
        self._key_lease: dict[str, int] = {}
        self._leases: dict[int, float] = {}  # id -> expiry on self.now
        self._lease_ttl: dict[int, int] = {}
        self._revision = 1
        self._next_lease = 1000
        self._history: list[WatchEvent] = []  # every change since the last compact()
        self._compacted = 0
        self._watches: list[_MemoryWatch] = []
        self.now = 0.0
        self.requests = 0

    # ---- test controls -------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
            self._expire()

    def compact(self, revision: int) -> None:
        """Like etcd's compaction: a watch from before ``revision`` raises WatchCompacted."""
        with self._lock:
            if revision > self._revision:
                raise ValueError(f"revision {revision} is in the future "
                                 f"(now {self._revision})")
            self._compacted = max(self._compacted, revision)
            self._history = [e for e in self._history if e.mod_revision >= revision]

    def break_watches(self) -> None:
        """Like an etcd restart: every open watch raises EtcdUnreachableError."""
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.fail(EtcdUnreachableError(
                self.endpoint, f"watching {watch.prefix}: the stream ended"))

    # ---- internals (under self._lock) ----------------------------------------------------
    def _expire(self) -> None:
        for lease in [lease for lease, expiry in self._leases.items() if expiry <= self.now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        """Forget ``lease`` and delete its keys, in one revision (as etcd does)."""
        self._leases.pop(lease, None)
        self._lease_ttl.pop(lease, None)
        keys = sorted(k for k, owner in self._key_lease.items() if owner == lease)
        if keys:
            revision = self._bump()
            for key in keys:
                self._delete(key, revision)

    def _bump(self) -> int:
        self._revision += 1
        return self._revision

    def _record(self, event: WatchEvent) -> None:
        self._history.append(event)
        for watch in self._watches:
            watch._offer(event)

    def _delete(self, key: str, revision: int | None = None) -> bool:
        self._key_lease.pop(key, None)
        if self._data.pop(key, None) is None:
            return False
        revision = revision or self._bump()
        self._record(WatchEvent("delete", key, b"", revision, 0))
        return True

    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseNotFound("etcdserver: requested lease not found")

    def _put(self, key: str, value: bytes, lease: int, revision: int | None = None
             ) -> KeyValue:
        """Write ``key`` at ``revision`` (a transaction's), or at a new revision."""
        self._check_lease(lease)
        revision = revision or self._bump()
        old = self._data.get(key)
        kv = KeyValue(key, bytes(value), revision, old.create_revision if old else revision)
        self._data[key] = kv
        if lease:
            self._key_lease[key] = lease
        else:
            self._key_lease.pop(key, None)
        self._record(WatchEvent("put", key, kv.value, revision, kv.create_revision))
        return kv

    def _unwatch(self, watch: _MemoryWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    # ---- KV ------------------------------------------------------------------------------
    def version(self) -> str:
        return "3.4.0-memory"

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self.requests += 1
            return self._data.get(key)

    def get_many(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        with self._lock:
            self.requests += 1
            return {k: self._data[k] for k in keys if k in self._data}

    def count_prefix(self, prefix: str) -> int:
        with self._lock:
            self.requests += 1
            return sum(1 for k in self._data if k.startswith(prefix))

    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._lock:
            self.requests += 1
            return ([self._data[k] for k in sorted(self._data) if k.startswith(prefix)],
                    self._revision)

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.put_many([(key, value)], lease)

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self._check_lease(lease)
            for chunk in chunks(list(items)):  # one etcd transaction, one revision, each
                revision = self._bump()
                for key, value in chunk:
                    self._put(key, value, lease, revision)

    def put_and_claim(self, key: str, value: bytes, claim: str, claim_value: bytes,
                      prefix: str, lease: int = 0) -> tuple[bool, list[KeyValue], int]:
        with self._lock:
            self.requests += 1
            self._check_lease(lease)
            revision = self._bump()  # one transaction, one revision
            self._put(key, value, lease, revision)
            if claim not in self._data:
                self._put(claim, claim_value, lease, revision)
                return True, [], revision
            return (False, [self._data[k] for k in sorted(self._data) if k.startswith(prefix)],
                    revision)

    def put_many_if_absent(self, guard: str, items: Sequence[tuple[str, bytes]],
                           lease: int = 0) -> bool:
        if len(items) > MAX_TXN_OPS:
            raise ValueError(f"{len(items)} keys in one transaction: etcd allows "
                             f"{MAX_TXN_OPS} (--max-txn-ops)")
        with self._lock:
            self.requests += 1
            if guard in self._data:
                return False
            self._check_lease(lease)
            if items:
                revision = self._bump()
                for key, value in items:
                    self._put(key, value, lease, revision)
            return True

    def swap(self, key: str, value: bytes, revision: int, lease: int = 0
             ) -> tuple[bool, KeyValue | None]:
        with self._lock:
            self.requests += 1
            current = self._data.get(key)
            if (current.mod_revision if current else 0) != revision:
                return False, current
            return True, self._put(key, value, lease)

    def swap_value(self, key: str, value: bytes, expected: bytes | None, lease: int = 0
                   ) -> tuple[bool, KeyValue | None]:
        with self._lock:
            self.requests += 1
            current = self._data.get(key)
            matches = current is None if expected is None else (
                current is not None and current.value == expected)
            if not matches:
                return False, current
            return True, self._put(key, value, lease)

    def delete(self, key: str) -> bool:
        with self._lock:
            self.requests += 1
            return self._delete(key)

    def grant_lease(self, ttl: int) -> int:
        with self._lock:
            self.requests += 1
            self._next_lease += 1
            self._leases[self._next_lease] = self.now + ttl
            self._lease_ttl[self._next_lease] = ttl
            return self._next_lease

    def keep_alive(self, lease: int) -> int:
        with self._lock:
            self.requests += 1
            if lease not in self._leases:
                return 0
            ttl = self._lease_ttl[lease]
            self._leases[lease] = self.now + ttl
            return ttl

    def revoke_lease(self, lease: int) -> None:
        with self._lock:
            self.requests += 1
            self._drop_lease(lease)

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        with self._lock:
            self.requests += 1
            start = start_revision if start_revision > 0 else self._revision + 1
            watch = _MemoryWatch(self, prefix, start)
            if start < self._compacted:
                watch.fail(WatchCompacted(self._compacted))
                return watch
            for event in self._history:
                watch._offer(event)
            self._watches.append(watch)
            return watch
