"""What ``elastic-train run`` tells its live agent: ``LiveOptions``, frozen, handed to each
agent by the factory that agent/live_agent.live_agent_installed gives torch's launcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic_train.agent.failure_detector import TIMEOUT as DETECTOR_TIMEOUT
from elastic_train.config import RecoveryMode

if TYPE_CHECKING:
    from elastic_train.agent.snapshot_holder import SnapshotHolder

C10D_JOIN_TIMEOUT = 600.0
"""torch's default ``join_timeout`` of the c10d rendezvous."""


@dataclass(frozen=True)
class LiveOptions:
    """What ``elastic-train run`` tells its agent (``live_agent_installed`` hands it to each
    agent torch's launcher builds)."""

    recovery: str = RecoveryMode.LIVE
    """'live' or 'restart' (the job's --recovery)."""
    listen_host: str | None = None
    """The IP address the agent's store listens on (None: every interface;
    store_binding.node_store_host)."""
    hot_spare: bool = False
    """Keep a spare worker forked and built (live/spare.py; ``--hot-spare``, the built-in
    trainer only)."""
    peer_timeout: float = DETECTOR_TIMEOUT
    """Seconds a peer may be unheard before it is suspected (agent/failure_detector.py; 0: no
    detector; ``--peer-timeout``)."""
    store_lost_seconds: float = C10D_JOIN_TIMEOUT
    """How long a c10d node whose store went silent waits for it to answer again (a
    cut-off node whose cable comes back rejoins) before it ends with one line: the
    rendezvous' ``join_timeout``, as long as a node may wait to join."""
    min_nodes: int = 1
    """The job's minimum of nodes (``--nnodes MIN:MAX``): a world is never re-formed in
    place with fewer."""
    memory_tier: SnapshotHolder | None = None
    """This agent's snapshot holder (agent/snapshot_holder.py; ``--memory-tier``), which
    the agent publishes to the others after each rendezvous round; None: off."""
