"""``MemoryKV``: an in-memory stand-in for etcd behind the ``KV`` protocol (tests only).

It keeps etcd's rules that the rendezvous relies on — one global revision incremented by
every write, a key's mod_revision and create_revision, revision 0 for an absent key,
leases that expire and take their keys with them — on a clock the test advances. The
contract tests run the same assertions against it and against a real etcd, which is what
keeps the two honest.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from elastic_train.rendezvous.client import KeyValue, LeaseNotFound


class MemoryKV:
    """Thread-safe fake of ``elastic_train.rendezvous.client.KV``."""

    endpoint = "memory://fake-etcd"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, KeyValue] = {}
        self._key_lease: dict[str, int] = {}
        self._leases: dict[int, float] = {}  # id -> expiry on self.now
        self._revision = 1
        self._next_lease = 1000
        self.now = 0.0
        self.requests = 0

    # ---- test controls -------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
            self._expire()

    def _expire(self) -> None:
        dead = {lease for lease, expiry in self._leases.items() if expiry <= self.now}
        for lease in dead:
            del self._leases[lease]
        for key in [k for k, lease in self._key_lease.items() if lease in dead]:
            self._delete(key)

    def _delete(self, key: str) -> bool:
        self._key_lease.pop(key, None)
        if self._data.pop(key, None) is None:
            return False
        self._revision += 1
        return True

    def _put(self, key: str, value: bytes, lease: int) -> KeyValue:
        if lease and lease not in self._leases:
            raise LeaseNotFound("etcdserver: requested lease not found")
        self._revision += 1
        old = self._data.get(key)
        kv = KeyValue(key, bytes(value), self._revision,
                      old.create_revision if old else self._revision)
        self._data[key] = kv
        if lease:
            self._key_lease[key] = lease
        else:
            self._key_lease.pop(key, None)
        return kv

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

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.put_many([(key, value)], lease)

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None:
        with self._lock:
            self.requests += 1
            if lease and lease not in self._leases:
                raise LeaseNotFound("etcdserver: requested lease not found")
            for key, value in items:
                self._put(key, value, lease)

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
            return self._next_lease
