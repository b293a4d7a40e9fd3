"""The agents' failure detector: heartbeats between peers, so that a silent node is seen in
seconds, not at a lease's or a collective's timeout.

A node that dies with its kernel alive says so at once (a refused connection, an EOF), and
live recovery acts on that. A host that loses power, panics, freezes (a VM pause, SIGSTOP)
or whose cable is pulled says nothing: a collective with it blocks until its timeout
(minutes), and the rendezvous notices only when the node's lease or heartbeat expires.

Here every agent of a generation watches its ``fanout`` successors on the ring of the
generation's members (the plan's order) over UDP: a ping every ``interval``, answered by
the peer's agent at once. A peer not heard from for ``timeout`` is *suspected*; the agent
that suspects it re-forms the world without it (agent/live_agent.py). Each agent is watched by
``fanout`` others, so one silent node is seen by several, and the re-formation's
coordination (two coordinators: the smaller id leads) settles who acts.

Why UDP and a thread of the agent's own: the answer must come from the agent process
itself (a frozen process must not answer; its kernel would accept a TCP connection), and
no request may wait on a silent peer (torch's TCPStore client ops ignore their timeout
against a frozen server). A datagram lost now and then costs nothing: ``timeout`` spans
several intervals. Costs: ``2 * fanout`` datagrams of ~80 bytes per interval per node,
whatever the job's size (docs/rendezvous-at-scale.md).

A false suspicion (a peer alive but unheard: a long stop of its whole process, a network
blip) costs a re-formation: the suspected node's plan is stale, it commits nothing (the
plan's compare-and-swap, the checkpoint writer's fence) and rejoins. Never a wrong result.

Messages are JSON, never pickles: ``{"ping": SEQ, "to": AGENT}``, answered with ``{"pong":
SEQ, "from": AGENT}`` (the name the ping was sent to: an agent answers before it knows its
own place); anything else is ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

INTERVAL = 0.25
"""Seconds between pings to each watched peer."""
TIMEOUT = 1.5
"""Seconds without an answer after which a watched peer is suspected (six pings)."""
MIN_TIMEOUT = 2 * INTERVAL
"""The shortest timeout that spans more than one ping."""
FANOUT = 2
"""Successors on the ring each agent watches (each agent is watched by as many)."""
_MAX_DATAGRAM = 512


@dataclass(frozen=True)
class Peer:
    """A member of the generation: its agent id and where its agent answers pings."""

    agent: str
    beat: str


def successors(ring: Sequence[str], me: str, fanout: int) -> list[str]:
    """The ``fanout`` members after ``me`` on ``ring`` (wrapping, never ``me``)."""
    if me not in ring:
        return []
    start = ring.index(me)
    others = [ring[(start + i) % len(ring)] for i in range(1, len(ring))]
    return others[:fanout]


class Suspicion:
    """Who is suspected, from when each watched peer was last heard from (pure: times are
    given, so that the rule is tested without a network)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._heard: dict[str, float] = {}

    def watch(self, peers: Sequence[str], now: float) -> None:
        """Watch exactly ``peers`` (the members of a generation just adopted) from now on.
        One newly watched counts as heard now, and so does one suspected now: it is a
        member of the generation it took part in forming (a cut-off node back from a
        partition would else suspect, at once, the peers it could not hear while cut off).
        The others keep the silence they had."""
        self._heard = {p: now if p not in self._heard or now - self._heard[p] > self.timeout
                       else self._heard[p] for p in peers}

    def heard(self, peer: str, now: float) -> None:
        if peer in self._heard:
            self._heard[peer] = now

    def suspects(self, now: float) -> set[str]:
        return {p for p, at in self._heard.items() if now - at > self.timeout}

    def silent_for(self, peer: str, now: float) -> float:
        return now - self._heard.get(peer, now)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class PeerHeartbeats:
    """This agent's side of the detector: answers every ping, pings the peers it watches,
    and calls ``on_suspect`` (from its thread) when one goes silent."""

    def __init__(self, host: str, on_suspect: Callable[[set[str]], None] | None = None, *,
                 interval: float = INTERVAL, timeout: float = TIMEOUT,
                 fanout: int = FANOUT) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self.interval = interval
        self.timeout = timeout
        self.fanout = fanout
        self._on_suspect = on_suspect
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[str, int]] = {}
        self._suspicion = Suspicion(timeout)
        self._reported: set[str] = set()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-heartbeats", daemon=True)
        self._thread.start()

    def beat_address(self, advertised_host: str) -> str:
        """HOST:PORT where peers ping this agent (``advertised_host``: as peers reach it)."""
        host = f"[{advertised_host}]" if ":" in advertised_host else advertised_host
        return f"{host}:{self.port}"

    def watch(self, me: str, members: Sequence[Peer]) -> None:
        """Watch ``me``'s successors among ``members`` (a generation, in rank order);
        members without a beat address (agents that do not answer) are never watched."""
        ring = [m.agent for m in members if m.beat or m.agent == me]
        beats = {m.agent: m.beat for m in members}
        chosen = successors(ring, me, self.fanout)
        with self._lock:
            self._watched = {a: _address(beats[a]) for a in chosen}
            self._suspicion.watch(chosen, time.monotonic())
            self._reported &= set(chosen)

    def suspects(self) -> set[str]:
        """The watched peers not heard from for the timeout, now."""
        with self._lock:
            return self._suspicion.suspects(time.monotonic())

    def silent_for(self, agent: str) -> float:
        with self._lock:
            return self._suspicion.silent_for(agent, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        next_ping = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = max(0.0, next_ping - time.monotonic())
                if selector.select(timeout=wait):
                    self._receive()
                now = time.monotonic()
                if now >= next_ping:
                    self._ping_all()
                    self._check(now)
                    next_ping = now + self.interval
        except OSError:
            if not self._stop.is_set():
                log.exception("the failure detector stopped: silent peers are now noticed "
                              "only by the rendezvous")
        finally:
            selector.close()

    def _receive(self) -> None:
        for _ in range(64):  # what is queued now, then back to the clock
            try:
                data, sender = self._sock.recvfrom(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ICMP port unreachable of an earlier ping: a peer gone
                continue
            try:
                message = json.loads(data)
                if "ping" in message:
                    reply = {"pong": int(message["ping"]), "from": str(message["to"])}
                else:
                    peer = str(message["from"]) if "pong" in message else None
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not ours: ignored
            if "ping" in message:
                with contextlib.suppress(OSError):
                    self._sock.sendto(json.dumps(reply).encode(), sender)
            elif peer is not None:
                with self._lock:
                    self._suspicion.heard(peer, time.monotonic())

    def _ping_all(self) -> None:
        with self._lock:
            targets = list(self._watched.items())
        self._seq += 1
        for agent, target in targets:
            with contextlib.suppress(OSError):
                self._sock.sendto(json.dumps({"ping": self._seq, "to": agent}).encode(), target)

    def _check(self, now: float) -> None:
        with self._lock:
            suspects = self._suspicion.suspects(now)
            fresh = suspects - self._reported
            self._reported = suspects  # one heard again is reported again if it falls silent
        if fresh and self._on_suspect is not None:
            self._on_suspect(fresh)
