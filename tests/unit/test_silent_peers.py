"""agent/silent_peers.py with real failure detectors on loopback: a member that falls
silent while the agent waits in a rendezvous round leaves the rendezvous at once (the fault
campaign, etcd-v3 seed 801), one already silent as the agent goes in too, and nothing is
left out of the rendezvous outside such a round. The handler is a recorder: what the
rendezvous does with ``forget_nodes`` is its own test (test_lease_rendezvous.py)."""

from __future__ import annotations

import json
import socket
import threading

from elastic_train.agent.silent_peers import SilentPeers
from elastic_train.live.plan import LIVE, Member, Plan
from tests.polling import wait_until

TIMEOUT = 0.5


class RecordingHandler:
    """A rendezvous handler of our own kind: it forgets the nodes it is told of."""

    def __init__(self) -> None:
        self.forgotten: list[set[str]] = []
        self.told = threading.Event()

    def forget_nodes(self, nodes: set[str]) -> list[str]:
        self.forgotten.append(set(nodes))
        self.told.set()
        return sorted(nodes)


def agents(count: int) -> tuple[list[SilentPeers], Plan]:
    peers = [SilentPeers("127.0.0.1", "127.0.0.1", TIMEOUT, lambda: None, None)
             for _ in range(count)]
    plan = Plan(1, LIVE, tuple(Member(f"agent-{i}", 1, f"node-{i}", p.beat)
                               for i, p in enumerate(peers)), "agent-0", "start")
    for i, p in enumerate(peers):
        p.adopted(f"agent-{i}", plan)
    return peers, plan


def test_a_member_falling_silent_during_the_round_leaves_the_rendezvous_at_once() -> None:
    (a, b, c), plan = agents(3)
    handler = RecordingHandler()
    try:
        with a.left_out_of_the_round(plan, handler):  # type: ignore[arg-type]
            assert handler.forgotten == []             # nobody silent yet
            b.close()                                 # agent-1 falls silent
            assert handler.told.wait(10 * TIMEOUT), "not left out"
        assert handler.forgotten == [{"node-1"}]
        c.close()                                     # outside a round: the loop acts
        wait_until(lambda: "agent-2" in a.silent(plan), 10 * TIMEOUT, "agent-2 suspected")
        assert handler.forgotten == [{"node-1"}]
    finally:
        for p in (a, b, c):
            p.close()


def test_a_member_already_silent_is_left_out_as_the_agent_goes_into_the_round() -> None:
    (a, b), plan = agents(2)
    handler = RecordingHandler()
    try:
        b.close()
        wait_until(lambda: "agent-1" in a.silent(plan), 10 * TIMEOUT, "agent-1 suspected")
        with a.left_out_of_the_round(plan, handler):  # type: ignore[arg-type]
            assert handler.forgotten == [{"node-1"}]
    finally:
        a.close()


class Responder:
    """A peer's answering side that can be cut off and put back: it answers the detector's
    pings only while ``answering`` is set (a pulled cable, then the cable back)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.beat = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answering = threading.Event()
        self.answering.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, sender = self.sock.recvfrom(512)
            except OSError:
                continue
            if self.answering.is_set():
                message = json.loads(data)
                self.sock.sendto(json.dumps({"pong": message["ping"],
                                             "from": message["to"]}).encode(), sender)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def test_a_peer_heard_again_is_silent_since_the_plan_but_no_longer_silent_now() -> None:
    """The round's waits ask ``silent_now``: a node back from a pulled cable joined a round
    with the peer it had suspected while cut off and, as the round's rank 0, gave up on it
    at once (a world of its own: worlds 2, 1, 2, 1, 2 in CI's run of a3f57e3)."""
    a = SilentPeers("127.0.0.1", "127.0.0.1", TIMEOUT, lambda: None, None)
    b = Responder()
    plan = Plan(1, LIVE, (Member("agent-0", 1, "node-0", a.beat),
                          Member("agent-1", 1, "node-1", b.beat)), "agent-0", "start")
    try:
        a.adopted("agent-0", plan)
        wait_until(lambda: a.silent(plan) == set() and a.silent_now(plan) == set(),
                   10 * TIMEOUT, "nobody suspected while both answer")
        b.answering.clear()                                  # the cable pulled
        wait_until(lambda: a.silent_now(plan) == {"agent-1"}, 10 * TIMEOUT, "suspected")
        assert a.silent(plan) == {"agent-1"}
        b.answering.set()                                    # and put back
        wait_until(lambda: a.silent_now(plan) == set(), 10 * TIMEOUT, "heard again")
        assert a.silent(plan) == {"agent-1"}                 # the loop's re-formation keeps it
    finally:
        a.close()
        b.close()
