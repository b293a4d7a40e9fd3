"""etcd outages: a job trains on while etcd is down, and what needs etcd waits for it.

Training needs etcd only when the membership changes (a node fails or joins). So while
etcd does not answer (restarted, partitioned), ``num_nodes_waiting`` reports nobody
waiting instead of failing the agent, and torch's heartbeats fail and are retried
(torch logs each). A rendezvous (at start, or after a failure) retries an unreachable etcd
for ``connect_timeout`` seconds, then fails with one line naming the endpoint.

When etcd answers again, every node's heartbeat is as old as the outage: judged by the
usual rule, every node would be dead and the world would be torn down for nothing. For one
dead-node timeout after an outage no node is declared dead, so that the live ones can
heartbeat first (``Outage.in_grace``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from elastic_train.rendezvous.etcd_v3.kv import EtcdUnreachableError

log = logging.getLogger(__name__)

T = TypeVar("T")

_FIRST_RETRY = 0.1
_MAX_RETRY = 1.0


class Outage:
    """Whether etcd is answering, as this node last saw it, and the grace after an outage."""

    def __init__(self, endpoint: str, grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.grace_seconds = grace_seconds
        self._clock = clock
        self.since: float | None = None
        self._grace_until = float("-inf")

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    @property
    def in_grace(self) -> bool:
        """Within one dead-node timeout after etcd came back: heartbeats are not judged."""
        return self._clock() < self._grace_until

    def failed(self, exc: EtcdUnreachableError) -> None:
        """etcd did not answer; the first failure of an outage is logged."""
        if self.since is None:
            self.since = self._clock()
            log.warning("etcd at %s does not answer (%s): training goes on; a rendezvous waits "
                        "for it (up to --rdzv-conf connect_timeout)", self.endpoint, exc.detail)

    def reached(self) -> None:
        """etcd answered; the end of an outage is logged and starts the grace."""
        if self.since is not None:
            log.warning("etcd at %s answers again after %.1f s", self.endpoint,
                        self._clock() - self.since)
            self.since = None
            self._grace_until = self._clock() + self.grace_seconds


def retry_unreachable(fn: Callable[[], T], timeout: float,
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, retried while etcd does not answer, for up to ``timeout`` seconds from the
    first failure; then the last ``EtcdUnreachableError``, saying how long it tried."""
    deadline: float | None = None
    delay = _FIRST_RETRY
    while True:
        try:
            return fn()
        except EtcdUnreachableError as exc:
            now = clock()
            if deadline is None:
                deadline = now + timeout
            if now >= deadline:
                raise EtcdUnreachableError(exc.endpoint, exc.detail, timeout) from None
            sleep(min(delay, deadline - now))
            delay = min(delay * 2, _MAX_RETRY)
