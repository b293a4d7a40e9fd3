"""The failure detector wired into the live agent: which peers are silent, and what follows.

agent/failure_detector.py pings the members of the agent's generation and calls back, from
its thread, when one falls silent. ``SilentPeers`` turns that call into what the agent acts
on: a warning, a wake-up of its monitor loop (which re-forms the world without them:
agent/live_agent.py), the suspects it keeps until the agent adopts its next plan, and on
c10d a check, in a thread, that the rendezvous store still answers (agent/store_watch.py:
torch's c10d handler would wait on a lost store without bound, in the agent's loop).
Kept apart from the agent's hooks so that they only ask whom to leave out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic_train.agent.failure_detector import Peer, PeerHeartbeats
from elastic_train.live.plan import Plan

__all__ = ["SilentPeers"]

log = logging.getLogger(__name__)


class SilentPeers:
    """This agent's failure detector (answering pings at ``beat``) and its suspects.

    ``wake`` wakes the agent's loop; ``check_store`` (on c10d) runs in a thread of its own
    when a peer falls silent, one at a time."""

    def __init__(self, listen_host: str | None, advertised_host: str, timeout: float,
                 wake: Callable[[], None], check_store: Callable[[], None] | None) -> None:
        self._wake = wake
        self._check_store = check_store
        self._store_check: threading.Thread | None = None
        self._silenced: set[str] = set()
        """Peers the detector suspected since this agent adopted its plan, kept even if they
        answer again: the loop may have been blocked meanwhile (torch's c10d handler waits
        on a store that the cut-off side cannot reach), and a peer that fell silent may
        have re-formed the world without this node, whose workers then wait in a
        collective of the old one. A false suspicion costs a re-formation, no more."""
        self._heartbeats = PeerHeartbeats(listen_host or "0.0.0.0", on_suspect=self._on_silent,
                                          timeout=timeout)
        self.beat = self._heartbeats.beat_address(advertised_host)
        """Where this agent answers the failure detector's pings (HOST:PORT)."""

    def adopted(self, me: str, plan: Plan) -> None:
        """The agent (``me``) adopted ``plan``: watch its members, forget older suspects."""
        self._silenced = set()
        self._heartbeats.watch(me, [Peer(m.agent, m.beat) for m in plan.members])

    def silent(self, plan: Plan) -> set[str]:
        """Members of ``plan`` the failure detector suspects now."""
        return (self._heartbeats.suspects() | self._silenced) & set(plan.agents)

    def close(self) -> None:
        self._heartbeats.close()

    def _on_silent(self, agents: set[str]) -> None:
        """The failure detector's call (its thread): peers fell silent; the loop acts."""
        log.warning("no answer from the agent(s) %s for %.1f s (failure detector): the world "
                    "re-forms without them", ", ".join(sorted(agents)),
                    self._heartbeats.timeout)
        self._silenced |= agents
        self._wake()
        checking = self._store_check is not None and self._store_check.is_alive()
        if self._check_store is not None and not checking:
            self._store_check = threading.Thread(target=self._check_store,
                                                 name="c10d-store-check", daemon=True)
            self._store_check.start()
