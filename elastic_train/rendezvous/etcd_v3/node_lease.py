"""One etcd lease per node (agent), kept alive by a thread: the node's liveness in etcd.

The node's rendezvous keys ride on it. While the agent lives, a thread renews the lease
every ``ttl / 3`` seconds (one small request; etcd's own clients renew as often); when the
agent dies, nobody renews it, etcd expires it after ``ttl`` seconds and deletes the node's
keys, and the other nodes, which watch those keys, see it at once. No heartbeat is ever
written into a shared value.

While etcd does not answer, renewals fail and are retried every ``RETRY_SECONDS``, each
bounded by ``renewal_timeout`` on a client of the lease's own (``EtcdKV.for_renewals``), so
that the first renewal after etcd answers again comes within about a second. A restarted
or newly elected etcd extends every lease itself (it restarts the leases' clocks); an etcd
cut off from the nodes does not: its leases keep counting down, and one whose node could
not renew it in time expires. So an outage alone declares nobody dead as long as it is
shorter than about ``ttl`` minus the renewal interval (6 s of the default 10); after a
longer one every node rejoins. If etcd says the lease is gone (``lost``), this node is no
longer part of any round: its agent must rejoin with a fresh lease.
"""

from __future__ import annotations

import logging
import threading

from elastic_train.rendezvous.etcd_v3.kv import KV, EtcdUnreachableError

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5
"""How soon a failed renewal is tried again (a renewal that worked waits ``ttl / 3``)."""


def renewal_timeout(ttl: int) -> float:
    """How long one renewal may take: well inside the renewal interval, so that a request
    stuck while etcd was away cannot hold the next one past the lease's expiry."""
    return max(0.5, min(2.0, ttl / 5))


class NodeLease:
    """The lease of this node; ``ensure`` grants it (again) and starts the renewals."""

    def __init__(self, kv: KV, ttl: int) -> None:
        if ttl < 2:
            raise ValueError(f"lease ttl {ttl}: at least 2 seconds")
        separate = getattr(kv, "for_renewals", None)
        self._kv: KV = separate(renewal_timeout(ttl)) if callable(separate) else kv
        self.ttl = ttl
        self.id = 0
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def lost(self) -> bool:
        """etcd no longer knows the lease: the node's keys are gone."""
        return self._lost.is_set()

    def ensure(self) -> int:
        """The live lease's id: a new one if there is none or it was lost."""
        with self._lock:
            if self.id and not self._lost.is_set():
                return self.id
            self._stop_thread()
            self.id = self._kv.grant_lease(self.ttl)
            self._lost.clear()
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew, args=(self.id,),
                                            name="etcd-v3-lease", daemon=True)
            self._thread.start()
            return self.id

    def _renew(self, lease: int) -> None:
        wait = self.ttl / 3
        while not self._stop.wait(wait):
            wait = min(RETRY_SECONDS, self.ttl / 3)  # unless this renewal works
            try:
                if self._kv.keep_alive(lease) <= 0:
                    log.warning("this node's etcd lease %x expired: it is no longer part of "
                                "the rendezvous and rejoins", lease)
                    self._lost.set()
                    return
                wait = self.ttl / 3
            except EtcdUnreachableError:
                continue  # the outage is logged by the rendezvous
            except Exception as exc:  # a renewal thread must not die silently
                log.warning("renewing this node's etcd lease failed (%s); retrying", exc)

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl)  # a renewal in flight ends within it
        self._thread = None

    def forget(self) -> None:
        """etcd said the lease is unknown (a write named it): the next ``ensure`` grants
        a new one."""
        self._lost.set()

    def revoke(self) -> None:
        """Stop renewing and revoke the lease: this node's keys go at once."""
        with self._lock:
            self._stop_thread()
            lease, self.id = self.id, 0
        if lease:
            try:
                self._kv.revoke_lease(lease)
            except EtcdUnreachableError:
                pass  # it expires on its own
