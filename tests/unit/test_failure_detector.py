"""agent/failure_detector.py: the suspicion rule (pure), and real heartbeats over UDP on loopback
between this process and a peer process that is frozen (SIGSTOP) and thawed."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from elastic_train.agent.failure_detector import Peer, PeerHeartbeats, Suspicion, successors

PEER = """
import sys, time
from elastic_train.agent.failure_detector import PeerHeartbeats
beats = PeerHeartbeats("127.0.0.1", interval=0.05, timeout=0.5)
print(beats.port, flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_each_member_watches_its_successors_on_the_ring():
    ring = ["a", "b", "c", "d"]
    assert successors(ring, "a", 2) == ["b", "c"]
    assert successors(ring, "d", 2) == ["a", "b"]
    assert successors(["a", "b"], "b", 2) == ["a"]
    assert successors(["a"], "a", 2) == []
    assert successors(ring, "x", 2) == []


def test_a_peer_is_suspected_once_unheard_for_the_timeout_and_cleared_when_heard():
    s = Suspicion(timeout=1.5)
    s.watch(["b", "c"], now=100.0)
    assert s.suspects(101.4) == set()
    s.heard("b", 101.0)
    assert s.suspects(101.6) == {"c"}
    assert s.suspects(102.6) == {"b", "c"}
    s.heard("c", 102.7)
    assert s.suspects(102.7) == {"b"}
    s.watch(["c", "d"], now=103.0)  # a new generation: b is not watched anymore
    assert s.suspects(103.1) == set()
    s.heard("x", 103.2)  # not watched: ignored
    assert s.silent_for("x", 104.0) == 0.0


def test_a_peer_suspected_when_a_new_generation_is_adopted_counts_as_heard_then():
    """A node back from a partition adopts a generation with the peer it could not hear:
    that peer formed the generation with it, and is not suspected at once; a peer with
    some silence short of the timeout keeps it."""
    s = Suspicion(timeout=1.5)
    s.watch(["a", "b"], now=100.0)
    s.heard("b", 109.0)
    assert s.suspects(110.0) == {"a"}                 # cut off from a since 100
    s.watch(["a", "b"], now=110.0)                    # the generation both are in again
    assert s.suspects(110.1) == set()
    assert s.silent_for("a", 111.0) == 1.0 and s.silent_for("b", 111.0) == 2.0
    assert s.suspects(111.2) == {"b"}                 # b's silence was kept


def _wait_for(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


@pytest.fixture
def peer_process():
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def test_a_frozen_peer_is_suspected_within_the_timeout_and_heard_again_when_thawed(
        peer_process):
    proc, port = peer_process
    silent: list[set[str]] = []
    beats = PeerHeartbeats("127.0.0.1", silent.append, interval=0.05, timeout=0.5)
    try:
        beats.watch("me", [Peer("me", beats.beat_address("127.0.0.1")),
                           Peer("peer", f"127.0.0.1:{port}")])
        time.sleep(1.0)  # answered all along: never suspected
        assert beats.suspects() == set() and silent == []
        proc.send_signal(signal.SIGSTOP)
        took = _wait_for(lambda: silent, timeout=5)
        assert silent == [{"peer"}] and beats.suspects() == {"peer"}
        assert 0.4 < took < 1.5, took
        proc.send_signal(signal.SIGCONT)
        _wait_for(lambda: not beats.suspects(), timeout=5)
        proc.kill()  # gone: suspected again, and reported again
        _wait_for(lambda: len(silent) == 2, timeout=5)
        assert silent[1] == {"peer"}
    finally:
        beats.close()


def test_members_without_a_beat_address_are_never_watched():
    beats = PeerHeartbeats("127.0.0.1", interval=0.05, timeout=0.2)
    try:
        beats.watch("me", [Peer("me", ""), Peer("old-agent", "")])
        time.sleep(0.4)
        assert beats.suspects() == set()
    finally:
        beats.close()


def test_anything_but_our_json_is_ignored_and_pings_are_answered():
    beats = PeerHeartbeats("127.0.0.1", interval=0.05, timeout=0.5)
    try:
        beats.watch("me", [Peer("me", beats.beat_address("127.0.0.1"))])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(2)
            for junk in (b"\x80\x04K\x01.", b"not json", b'{"ping": 1}', b"[]", b"7",
                         b'{"ping": "x", "to": "me"}'):
                s.sendto(junk, ("127.0.0.1", beats.port))
            s.sendto(json.dumps({"ping": 7, "to": "me"}).encode(), ("127.0.0.1", beats.port))
            answer = json.loads(s.recvfrom(512)[0])
        assert answer == {"pong": 7, "from": "me"}
    finally:
        beats.close()


def test_the_launcher_takes_a_peer_timeout_of_zero_or_of_two_pings_at_least():
    from elastic_train.agent.launch import launcher_parser

    parser = launcher_parser()
    assert parser.parse_args([]).peer_timeout == 1.5
    assert parser.parse_args(["--peer-timeout", "0"]).peer_timeout == 0
    assert parser.parse_args(["--peer-timeout", "4"]).peer_timeout == 4
    for bad in ("0.1", "-1", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--peer-timeout", bad])

