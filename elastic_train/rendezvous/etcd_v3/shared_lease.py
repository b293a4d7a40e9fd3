"""One etcd lease shared by the rendezvous state and the store's keys, renewed by replacement.

Every write attaches the current lease. A lease older than half its TTL is replaced by a
fresh one at the next write, so a key lives between ttl/2 and ttl after its last write
(nothing outlives an abandoned job), at the cost of about two lease grants per TTL per
node instead of one per write, and with no keep-alive thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elastic_train.rendezvous.etcd_v3.kv import KV, LeaseNotFound

T = TypeVar("T")


class SharedLease:
    """The lease writes attach; ``ttl`` 0 means keys never expire."""

    def __init__(self, kv: KV, ttl: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._kv = kv
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._lease = 0
        self._granted_at = 0.0

    def current(self) -> int:
        """The lease id to attach to a write now (0: none)."""
        if self.ttl <= 0:
            return 0
        with self._lock:
            if not self._lease or self._clock() - self._granted_at >= self.ttl / 2:
                self._granted_at = self._clock()
                self._lease = self._kv.grant_lease(self.ttl)
            return self._lease

    def write(self, fn: Callable[[int], T]) -> T:
        """Run ``fn(lease)``; if etcd no longer knows the lease, grant another and retry once."""
        try:
            return fn(self.current())
        except LeaseNotFound:
            with self._lock:
                self._lease = 0
            return fn(self.current())
