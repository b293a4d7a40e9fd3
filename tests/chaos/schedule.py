"""A fault campaign's schedule: which faults, on which host, held how long, how far apart.

Pure and seeded: ``make_schedule(seed, ...)`` gives the same faults for the same seed, and a
schedule is written to and read from JSON (``encode`` / ``decode``), so that a campaign that
failed is replayed from its file or its seed (tests/integration/test_fault_campaign.py keeps
such replays as regression tests).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Kind:
    """A kind of fault: what it needs of the bed and of the job, and what it does."""

    name: str
    doc: str
    silent: bool = False
    """The victim says nothing (no EOF, no refused connection): found by timeouts."""
    node_leaves: bool = False
    """The victim's node leaves the world (its agent ends or is cut off)."""
    needs_etcd: bool = False
    needs: str | None = None
    """A tool of the bed it needs: ``iptables`` or ``netem`` (Netbed.supports)."""


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("host_kill", "every process of a host SIGKILLed, its agent started again after "
         "the hold", node_leaves=True),
    Kind("cable", "a host's cable pulled, put back after the hold", silent=True,
         node_leaves=True),
    Kind("freeze", "every process of a host SIGSTOPped, SIGCONTed after the hold",
         silent=True, node_leaves=True),
    Kind("worker_kill", "one worker SIGKILLed (its agent lives on)"),
    Kind("agent_freeze", "a host's agent alone SIGSTOPped, its workers train on (a false "
         "suspicion), SIGCONTed after the hold", silent=True),
    Kind("one_way", "packets to (or from) a host lost, restored after the hold", silent=True,
         node_leaves=True, needs="iptables"),
    Kind("slow_link", "a host's link delayed (netem; where the kernel lacks it, its rate "
         "cut by tbf) for the hold"),
    Kind("etcd_kill", "etcd SIGKILLed, started again on its data after the hold",
         needs_etcd=True),
    Kind("etcd_cable", "etcd's host's cable pulled, put back after the hold", silent=True,
         needs_etcd=True),
    Kind("node_sigterm", "one agent SIGTERMed (a spot node reclaimed): it leaves, the others "
         "train on; started again after the hold", node_leaves=True),
    Kind("kill_while_joining", "a host killed, its agent started again and killed again "
         "while it joins, then started again", node_leaves=True),
    Kind("disk_full", "the run dir's file system full for the hold"),
)}

HOLD = (3.0, 15.0)
"""A fault's hold, seconds (uniform)."""
GAP = (0.0, 6.0)
"""Seconds between a fault's heal and the next fault (uniform)."""
WAIT_HEAL = 0.5
"""The share of faults after whose heal the campaign waits for the full world before the
gap (the others' next fault may land during their recovery)."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule."""

    kind: str
    host: str
    """The victim host (for etcd's faults: the etcd host)."""
    hold: float
    gap: float
    wait_heal: bool
    """Wait for the full world after the heal before the gap."""
    detail: dict[str, object] = field(default_factory=dict)
    """Kind-specific choices: ``direction`` (one_way), ``delay_ms`` (slow_link),
    ``local_rank`` (worker_kill), ``join_kill_after`` (kill_while_joining)."""

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.detail.items()))
        return f"{self.kind} {self.host} hold {self.hold:.1f}s gap {self.gap:.1f}s{extra}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    faults: tuple[Fault, ...]

    def encode(self) -> str:
        return json.dumps({"seed": self.seed, "faults": [asdict(f) for f in self.faults]},
                          indent=1)

    @classmethod
    def decode(cls, text: str) -> Schedule:
        raw = json.loads(text)
        return cls(int(raw["seed"]), tuple(Fault(**f) for f in raw["faults"]))


def make_schedule(seed: int, count: int, hosts: Sequence[str], kinds: Sequence[str],
                  nproc: int = 1, hold: tuple[float, float] = HOLD,
                  gap: tuple[float, float] = GAP, wait_heal: float = WAIT_HEAL,
                  etcd_host: str = "etcd", protected: Sequence[str] = ()) -> Schedule:
    """``count`` faults drawn from ``kinds`` (uniformly), each on a host of ``hosts`` (etcd's
    on ``etcd_host``), with holds and gaps drawn from their ranges. A ``protected`` host
    (c10d's store host: its loss is a scenario of its own) never loses its node or its
    agent."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}: choose from {sorted(KINDS)}")
    if not kinds or not hosts:
        raise ValueError("a schedule needs at least one fault kind and one host")
    rng = random.Random(seed)
    faults = []
    for _ in range(count):
        kind = rng.choice(list(kinds))
        spared = KINDS[kind].node_leaves or KINDS[kind].silent
        choices = [h for h in hosts if not (spared and h in protected)] or list(hosts)
        host = etcd_host if KINDS[kind].needs_etcd else rng.choice(choices)
        detail: dict[str, object] = {}
        if kind == "one_way":
            detail["direction"] = rng.choice(["incoming", "outgoing"])
        elif kind == "slow_link":
            detail["delay_ms"] = rng.choice([20, 50, 100])
            detail["rate"] = rng.choice(["5mbit", "20mbit", "100mbit"])
        elif kind == "worker_kill":
            detail["local_rank"] = rng.randrange(nproc)
        elif kind == "kill_while_joining":
            detail["join_kill_after"] = round(rng.uniform(0.5, 3.0), 2)
        faults.append(Fault(kind, host, round(rng.uniform(*hold), 2),
                            round(rng.uniform(*gap), 2), rng.random() < wait_heal, detail))
    return Schedule(seed, tuple(faults))
