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

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastic_train.agent.failure_detector import Peer, PeerHeartbeats
from elastic_train.live.plan import Plan
from elastic_train.rendezvous.forget import forget_nodes

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
        self._listeners: list[Callable[[set[str]], None]] = []  # ``telling``
        self._heartbeats = PeerHeartbeats(listen_host or "0.0.0.0", on_suspect=self._on_silent,
                                          timeout=timeout)
        self.beat = self._heartbeats.beat_address(advertised_host)
        """Where this agent answers the failure detector's pings (HOST:PORT)."""

    def adopted(self, me: str, plan: Plan) -> None:
        """The agent (``me``) adopted ``plan``: watch its members, forget older suspects."""
        self._silenced = set()
        self._heartbeats.watch(me, [Peer(m.agent, m.beat) for m in plan.members])

    def silent(self, plan: Plan) -> set[str]:
        """Members of ``plan`` the failure detector suspected since the agent adopted it
        (kept even if they answer again: for the loop's re-formation)."""
        return (self._heartbeats.suspects() | self._silenced) & set(plan.agents)

    def silent_now(self, plan: Plan) -> set[str]:
        """Members of ``plan`` not heard from for the detector's timeout, now: what a
        rendezvous round's wait may give up on (agent/live_node.silent_in_round). A peer
        suspected while this node was cut off and heard again since is no longer in it:
        rank 0 of the round that node joins on its way back gave up on such a peer at
        once and formed a world of its own (test_etcd_v3_the_writers_cable_pulled_and_put_back
        in the CI run of a3f57e3: worlds 2, 1, 2, 1, 2)."""
        return self._heartbeats.suspects() & set(plan.agents)

    @contextlib.contextmanager
    def telling(self, listener: Callable[[set[str]], None]) -> Iterator[None]:
        """Within the block, also call ``listener`` (in the detector's thread) with the
        peers that fall silent: for what the agent's loop cannot do meanwhile, as while it
        waits in a rendezvous round (agent/live_agent.py)."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)

    @contextlib.contextmanager
    def left_out_of_the_round(self, plan: Plan, handler: RendezvousHandler) -> Iterator[None]:
        """While the agent waits in a rendezvous round with its workers training on (a node
        joins), a member of ``plan`` that is silent (already, or falls silent meanwhile) is
        left out of the rendezvous at once: the round, which waits for the previous world's
        live members, must not wait for it until its lease expires while the workers sit
        in a collective with it (the fault campaign, etcd-v3 seed 801: a one-way loss as a
        node joined held every step 7 s; on c10d, torch's round waits for every member of
        the last one to leave it: seeds 862 and 863, up to 15.7 s)."""

        def leave_out(agents: set[str]) -> None:
            nodes = [m.rdzv_node for m in plan.members if m.agent in agents]
            gone = agents | self.silent(plan)
            staying = [m.rdzv_node for m in plan.members if m.agent not in gone]
            if forget_nodes(handler, nodes, coordinator=False, in_round=True,
                            staying=staying):
                log.warning("agent(s) %s fell silent while the rendezvous round forms: the "
                            "round goes on without them", ", ".join(sorted(agents)))

        with self.telling(leave_out):
            suspected = self.silent(plan)
            if suspected:
                leave_out(suspected)
            yield

    def close(self) -> None:
        self._heartbeats.close()

    def _on_silent(self, agents: set[str]) -> None:
        """The failure detector's call (its thread): peers fell silent; the loop acts."""
        log.warning("no answer from the agent(s) %s for %.1f s (failure detector): the world "
                    "re-forms without them", ", ".join(sorted(agents)),
                    self._heartbeats.timeout)
        self._silenced |= agents
        self._wake()
        for listener in list(self._listeners):
            try:
                listener(agents)
            except Exception as exc:  # the detector's thread must go on
                log.warning("acting on silent agent(s) %s failed: %s: %s",
                            ", ".join(sorted(agents)), type(exc).__name__, exc)
        checking = self._store_check is not None and self._store_check.is_alive()
        if self._check_store is not None and not checking:
            self._store_check = threading.Thread(target=self._check_store,
                                                 name="c10d-store-check", daemon=True)
            self._store_check.start()
