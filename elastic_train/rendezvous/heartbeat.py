"""Heartbeat settings under which torch's rendezvous handler keeps live nodes.

Free of torch imports: the launcher checks ``--rdzv-conf`` before it imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from elastic_train.errors import ConfigError, RendezvousConfigError

# torch's defaults, kept by every backend: a dead node is noticed after 5 s x 3 = 15 s,
# which holds up at 64 nodes.
KEEP_ALIVE_INTERVAL = 5.0
KEEP_ALIVE_MAX_ATTEMPT = 3


def check_keep_alive(interval: float, attempts: int) -> None:
    """Refuse heartbeat settings under which torch takes live nodes for dead.

    torch's rendezvous handler refreshes a node's heartbeat only once it is one interval
    old, polls the shared state once a second and caches it for a second, so a live
    node's last heartbeat can look up to two intervals plus about 2 s old — more right
    after a round completes. A node is declared dead after ``interval * attempts``: below
    ``2 * interval + 3`` s a live node gets dropped and its agent trains on alone (a
    split world). Measured: interval 1 s with 2 attempts drops the first node of a round.
    """
    needed = 2 * interval + 3
    if interval * attempts < needed:
        fewest = int(-(-needed // interval))
        raise RendezvousConfigError(
            f"--rdzv-conf keep_alive_interval={interval:g} with keep_alive_max_attempt="
            f"{attempts} declares a node dead after {interval * attempts:g} s, but a live "
            f"node's heartbeat can be {needed:g} s old: use keep_alive_max_attempt={fewest} "
            "or more")


def check_keep_alive_conf(backend: str, conf: Mapping[str, str]) -> None:
    """``check_keep_alive`` on the ``--rdzv-conf`` of one of torch's backends (c10d,
    etcd-v2), which read both settings as whole numbers."""
    try:
        interval = int(conf.get("keep_alive_interval", KEEP_ALIVE_INTERVAL))
        attempts = int(conf.get("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT))
    except ValueError:
        raise ConfigError("--rdzv-conf keep_alive_interval and keep_alive_max_attempt "
                          f"must be whole numbers for {backend}") from None
    check_keep_alive(interval, attempts)
