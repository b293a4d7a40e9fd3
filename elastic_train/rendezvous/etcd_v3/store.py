"""``EtcdStore``: the c10d ``Store`` torch's agents share through etcd, under a key prefix.

The agents use it after each rendezvous round (through a per-round ``PrefixStore``): rank
0 publishes the workers' master address, ranks are assigned with ``multi_get`` /
``multi_set``, and the exit barrier counts with ``add`` and ``wait``. Values are bytes;
``add`` and ``compare_set`` are compare-and-swap loops on the key's revision, so they are
atomic across agents. Blocking reads poll with a short backoff (10 ms doubling to 100 ms)
until the store's timeout, then raise ``DistStoreError`` like torch's stores. Every key
carries the shared lease, so a finished job's keys expire with its state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from elastic_train.rendezvous.etcd_v3.kv import KV, KeyValue
from elastic_train.rendezvous.etcd_v3.outage import retry_unreachable
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease

T = TypeVar("T")

_FIRST_POLL = 0.01
_MAX_POLL = 0.1


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d store whose keys live in etcd under ``prefix``."""

    def __init__(self, kv: KV, prefix: str, lease: SharedLease,
                 timeout: timedelta = timedelta(seconds=60), retry_seconds: float = 0.0
                 ) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._kv = kv
        self._lease = lease
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.retry_seconds = retry_seconds
        """How long an operation retries an etcd that does not answer (--rdzv-conf
        connect_timeout): a rendezvous or a re-formation under way when etcd restarts waits
        for it instead of failing the agent (found by the fault campaign: every agent ended
        when etcd was killed while a node joined)."""
        self.set_timeout(timeout)

    def _retried(self, fn: Callable[[], T]) -> T:
        return retry_unreachable(fn, self.retry_seconds) if self.retry_seconds > 0 else fn()

    def _key(self, key: str) -> str:
        return self.prefix + key

    # ---- writes --------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._retried(lambda: self._lease.write(
            lambda lease: self._kv.put(self._key(key), _bytes(value), lease)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        items = [(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._retried(lambda: self._lease.write(lambda lease: self._kv.put_many(items, lease)))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent: 0); return the new value. (A
        swap that etcd applied but whose answer was lost is retried as a new add.)"""
        return self._retried(lambda: self._add(key, amount))

    def _add(self, key: str, amount: int) -> int:
        full = self._key(key)
        current = self._kv.get(full)
        while True:
            base = int(current.value) if current is not None else 0
            new = base + amount
            revision = current.mod_revision if current is not None else 0

            def write(lease: int, revision: int = revision, new: int = new
                      ) -> tuple[bool, KeyValue | None]:
                return self._kv.swap(full, str(new).encode(), revision, lease)

            succeeded, current = self._lease.write(write)
            if succeeded:
                return new

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """c10d semantics: set if the value is ``expected`` (or absent and ``expected`` is
        empty); return the value now held (``expected`` if absent and not set). Retried
        whole: a swap applied whose answer was lost reads back as the desired value."""
        return self._retried(lambda: self._compare_set(key, expected_value, desired_value))

    def _compare_set(self, key: str, expected_value: str | bytes,
                     desired_value: str | bytes) -> bytes:
        full, expected, desired = self._key(key), _bytes(expected_value), _bytes(desired_value)
        while True:
            current = self._kv.get(full)
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            guard = None if current is None else expected

            def write(lease: int, guard: bytes | None = guard) -> tuple[bool, KeyValue | None]:
                return self._kv.swap_value(full, desired, guard, lease)

            succeeded, _ = self._lease.write(write)
            if succeeded:
                return desired

    def delete_key(self, key: str) -> bool:
        return self._retried(lambda: self._kv.delete(self._key(key)))

    # ---- reads ---------------------------------------------------------------------------
    def _wait_for(self, keys: Sequence[str], timeout: timedelta | None) -> dict[str, bytes]:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        full = [self._key(k) for k in keys]
        delay = _FIRST_POLL
        while True:
            found = self._retried(lambda: self._kv.get_many(full))
            if len(found) == len(full):
                return {k: found[f].value for k, f in zip(keys, full, strict=True)}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, f in zip(keys, full, strict=True) if f not in found]
                raise dist.DistStoreError(
                    f"timed out after {limit:g} s waiting for {missing} under {self.prefix} "
                    f"on etcd at {self._kv.endpoint}: another agent did not write them")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL)

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[key]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self._wait_for(keys, None)
        return [values[k] for k in keys]

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        full = [self._key(k) for k in keys]
        return len(self._retried(lambda: self._kv.get_many(full))) == len(full)

    def num_keys(self) -> int:
        return self._retried(lambda: self._kv.count_prefix(self.prefix))
