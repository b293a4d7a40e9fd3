"""Live recovery across agents, the coordination: how the agents of a job agree on the next
plan (live/plan.py says what is in one), torch-free, on a small store interface (``Store``,
``Peers``), so that its races run in unit tests over an in-memory store
(tests/unit/test_coordination.py).

``Coordinator`` is one agent's side of it; the agent (agent/live_agent.py) owns torch's
hooks and the translation to and from torch's worker group, and calls it:

- ``agree_on_round`` after every rendezvous round: every agent of the round says what it
  brings (its ``Arrival``) in the round's store; group rank 0 decides (``plan_round``),
  takes the job's plan key over (a new round supersedes every plan before it) and writes
  the round's plan for the others to read. An agent of the round that does not take part
  (plain torchrun) makes the round a stock one: every worker starts the torch way.
- ``reform`` within a round, when a worker, a collective or a peer was lost: the agent that
  noticed first calls every member of the generation before in that member's own store
  (``Peers``: an agent that died refuses at once), takes those that arrive within
  ``ARRIVE_SECONDS``, and commits the next plan (``plan_reformation``) by compare-and-swap
  of the job's plan key from the plan it replaces (``commit_plan``). So of two coordinators
  at once only one commits (and the one with the larger id follows the other as soon as it
  sees its call); a coordinator whose world was superseded (cut off, frozen, thawed)
  commits nothing and learns the newer plan; a minority below the job's minimum of nodes
  never re-forms (every node takes torch's restart path); members whose state is of an
  older generation than the newest held start again (``plan._without_stale_holders``).
  A member follows its coordinator (``follow``), and coordinates itself when that one is
  gone (``REFORM_ATTEMPTS``).
- ``leave`` when this agent takes torch's restart path out of a world with other members
  (its live restarts spent, its workers not ready): it tells them in their stores
  (``leaving_key``), and they re-form without it at once (``leavers``), neither calling it
  nor waiting for it.

Where does a new recovery path go? Its decision (who is in the next world, from what) in
live/plan.py, as a pure function of arrivals; its agreement (who decides, how the others
learn it, what a stale or concurrent decider gets) here, as a method of ``Coordinator``
over ``Store`` and ``Peers`` with a race test in tests/unit/test_coordination.py; only what
it does to the workers (start, restart, announce) in agent/live_agent.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import elastic_train.live.round_waits as waits
from elastic_train.errors import RoundMemberLostError
from elastic_train.live.plan import Arrival, Plan, plan_reformation, plan_round

log = logging.getLogger(__name__)

PREFIX = "elastic_train/agents"
NOTICE_KEY = f"{PREFIX}/notice"
RESTART = b"restart"
"""What a coordinator publishes instead of a plan when no member holds the state."""
REDIRECT = b"follow:"
"""What a coordinator that yielded to a rival publishes as its plan: the rival's notice
after it. Members that arrived at the one that yielded follow the rival instead (a member
called by both may have kept either call: one key holds the newest)."""
UNCOMMITTED = b"uncommitted"
"""A coordinator's outcome when it could not reach the rendezvous' store to commit."""
STOCK_ROUND = b"stock"
"""The round's plan when some agent of it is not ours: every worker starts the torch way."""
NEXT_ROUND = b"next-round"
"""The round's plan when one of our agents was lost before it said what it brings: every
member goes into the next rendezvous round (a stock round instead turned live recovery off
until the next round: the fault campaign, c10d seed 642's replay, a cable pulled 13.5 s)."""
ROUND_PREFIX = "elastic_train/live"
COMMITTED_KEY = f"{ROUND_PREFIX}/plan"
LOST_KEY = f"{ROUND_PREFIX}/lost"
"""The round's agents that an agent of it gave up on (live/round_waits.py)."""
"""The newest committed plan: in the rendezvous' store under the job's prefix (across
rounds: the agent's job store), and each round's first plan in the round's store too."""
ARRIVE_SECONDS = 10.0
"""How long a coordinator waits for a member that took its call to arrive (members look
for calls every --monitor-interval; one busy in a rendezvous round comes later)."""
FOLLOW_SECONDS = ARRIVE_SECONDS + 5.0
"""How long a member waits for its coordinator's plan before it coordinates itself."""
REFORM_ATTEMPTS = 3
MIXED_ROUND_SECONDS = 5.0
"""How long group rank 0 waits for the other agents of a round to say what they bring
before it takes the round for one with plain torchrun agents in it."""
ROUND_PLAN_SECONDS = 10.0
"""How long an agent of a round waits for the plan its rank 0 decides, once rank 0 said
what it brings (it decides within milliseconds): missing by then, rank 0 was lost right
after the round closed (``RoundMemberLostError``; the agent goes into the next round). The
store's own timeout (60 s) ended the agents instead (the fault campaign, etcd-v3 seed 540)."""
LEAVING_PREFIX = f"{PREFIX}/leaving"
"""Under it, in the other members' stores, an agent that leaves the world says so (its
value: the generation it leaves). Without it, the member that noticed the failure called the
leaving agent, busy with torch's restart path, and waited ``ARRIVE_SECONDS`` for it; the
leaving node's new rendezvous round meanwhile closed with it alone, trained from the newest
checkpoint and took the job's plan over (the fault campaign, etcd-v3 seed 561)."""


class Store(Protocol):
    """What coordination needs of a store (torch's ``dist.Store`` offers it; so does the
    in-memory one of the tests). ``wait`` raises (``RuntimeError``, ``TimeoutError``)
    when the keys are not all set within ``timeout``."""

    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: str | bytes) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class Peers(Protocol):
    """The other agents' stores, by address (live/peers.PeerStores): ``tell`` sets a key
    there and wakes that agent (False: it is gone), ``tell_all`` in several at once (not
    waiting for a call to an address in ``abandon()``; with ``keep``, a value there that
    ``keep(present, value)`` prefers stays), ``read`` waits for a key there (None: not
    within ``timeout``, or it is gone)."""

    def tell(self, address: str, key: str, value: str | bytes) -> bool: ...

    def tell_all(self, addresses: Iterable[str], key: str, value: str | bytes,
                 abandon: Callable[[], Iterable[str]] = tuple,
                 keep: Callable[[bytes, bytes], bool] | None = None) -> set[str]: ...

    def read(self, address: str, key: str, timeout: float) -> bytes | None: ...


def arrival_key(generation: int, agent: str) -> str:
    return f"{PREFIX}/reform/{generation}/arrival/{agent}"


def leaving_key(agent: str) -> str:
    """Where ``agent`` says, in another member's store, that it leaves the world."""
    return f"{LEAVING_PREFIX}/{agent}"


def plan_key(generation: int) -> str:
    return f"{PREFIX}/reform/{generation}/plan"


@dataclass(frozen=True)
class Notice:
    """A coordinator's call to re-form as ``generation``."""

    generation: int
    coordinator: str

    def encode(self) -> str:
        return json.dumps({"generation": self.generation, "coordinator": self.coordinator})

    @classmethod
    def decode(cls, data: str | bytes) -> Notice:
        raw = json.loads(data)
        return cls(int(raw["generation"]), str(raw["coordinator"]))


def preferred_call(present: bytes, ours: bytes) -> bool:
    """Whether a member keeps the call already in its notice key over ours: a newer
    generation's, or the same generation's from a smaller id (the one that coordinates).
    Several agents calling at once each write that one key; kept as it came, the last
    writer's call hid the smallest id's, and a member it hid from waited its arrival
    timeout as a rival coordinator (the fault campaign, seed 306: three agents called at
    once after a worker kill; 10 s later one node trained alone, two left out)."""
    try:
        there, mine = Notice.decode(present), Notice.decode(ours)
    except (ValueError, KeyError, TypeError):
        return False
    if there.generation != mine.generation:
        return there.generation > mine.generation
    return there.coordinator < mine.coordinator


def offer(store: Store, key: str, value: bytes, keep: Callable[[bytes, bytes], bool],
          tries: int = 8) -> bytes:
    """Put ``value`` at ``key`` unless the value there is one ``keep(present, value)``
    prefers; what is there after. By compare-and-swap, so that of callers racing for one
    key the preferred value stays whatever the order they arrive in."""
    expected = b""  # absent, at first guess
    present = b""
    for _ in range(tries):
        present = bytes(store.compare_set(key, expected, value))
        if present == value or keep(present, value):
            return present
        expected = present
    return present


def local_value(store: Store, key: str) -> bytes | None:
    """``key`` in a store of this process' own (None when absent or the store is gone)."""
    with contextlib.suppress(RuntimeError, OSError):
        if store.check([key]):
            return store.get(key)
    return None


def commit_plan(store: Store, key: str, base: bytes, plan: bytes) -> bytes:
    """Swap the plan at ``key`` from ``base`` (the plan it replaces, exactly as committed;
    empty: none yet) to ``plan``; the plan committed now. Of two coordinators that decided
    from the same base only the first commits; a coordinator that decided from a stale
    base (a partitioned minority, a world that moved on) commits nothing and learns the
    newer plan."""
    return bytes(store.compare_set(key, base, plan))


def take_over(store: Store, key: str, plan: Plan, tries: int = 20) -> bytes:
    """Make ``plan`` the plan at ``key`` whatever it replaces (a new rendezvous round's
    plan supersedes every plan before it): a compare-and-swap from the value read, again
    if another commit came in between; the plan as committed. A coordinator of an older
    world that swaps from its own plan after this finds the key changed and commits
    nothing.

    Its generation is above the replaced plan's, whoever committed that one: a node cut
    off while the others formed this round may have committed a world of its own in place
    (its compare-and-swap reached the store as its cable came back), numbered from the
    same base; two worlds of one generation would each hold "the newest" state, and a
    later round could not tell the stale one (the fault campaign, seed 300)."""
    for _ in range(tries):
        current = bytes(store.get(key)) if store.check([key]) else b""
        replaced = _generation_of(current)
        if replaced is not None and plan.generation <= replaced:
            plan = dataclasses.replace(plan, generation=replaced + 1)
        raw = plan.encode()
        if commit_plan(store, key, current, raw) == raw:
            return raw
    raise RuntimeError(f"could not commit a new round's plan at {key}: it kept changing")


def _generation_of(raw: bytes) -> int | None:
    """The generation of the plan committed as ``raw`` (None: none, or not a plan)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return int(json.loads(raw)["generation"])
    return None


Outcome = tuple[Plan, bytes] | bytes | None
"""Of a re-formation: (the plan, as committed), RESTART (no member holds the state),
UNCOMMITTED (the job's store did not take it) or None (the coordinator is gone)."""


def _direct(call: Callable[[], bytes]) -> bytes:
    return call()


@dataclass(frozen=True)
class Round:
    """The rendezvous round as coordination sees it: its store (shared by its agents) and
    this agent's place in it."""

    store: Store
    rank: int
    size: int
    ours: frozenset[int] = frozenset()
    """(Known to rank 0) the ranks whose agents are ours (their rank assignment says so):
    one of them that does not say what it brings was lost right after the round closed,
    and the round is done again without it, not started the torch way."""
    suspect: waits.Suspect | None = None
    """Whether the failure detector suspects one of these ranks (live/round_waits.py)."""


class Coordinator:
    """One agent's side of the coordination (see the module).

    ``address``: the agent's id in plans; ``node_store``: the agent's own store (peers call
    it there, its plans are read there); ``peers``: the other agents' stores; ``min_nodes``:
    a world never re-forms in place with fewer; ``bounded``: how a commit to the job's
    store is called (c10d's store may never answer: the agent bounds the call);
    ``suspects``: the members the failure detector suspects now (never waited for).
    """

    def __init__(self, address: str, node_store: Store, peers: Peers, min_nodes: int = 1,
                 bounded: Callable[[Callable[[], bytes]], bytes] = _direct,
                 arrive_seconds: float = ARRIVE_SECONDS,
                 follow_seconds: float = FOLLOW_SECONDS,
                 suspects: Callable[[], Iterable[str]] = tuple) -> None:
        self.address = address
        self.node_store = node_store
        self.peers = peers
        self.min_nodes = min_nodes
        self.bounded = bounded
        self.arrive_seconds = arrive_seconds
        self.follow_seconds = follow_seconds
        self.suspects = suspects
        """The members the failure detector suspects now: a member that took a call and
        falls silent before it arrives (its host frozen or cut off just then) is not
        waited for beyond the detector's timeout."""
        self.plan: Plan | None = None
        self.plan_raw = b""
        """The plan as committed (the job's store swaps from these exact bytes)."""
        self.noticed = -1
        """The newest generation a peer's notice asked for, handled."""

    def adopt(self, plan: Plan | None, raw: bytes = b"") -> None:
        """Take ``plan`` (as committed: ``raw``) as this agent's generation (None: none)."""
        self.plan, self.plan_raw = plan, raw

    # ---- a round's first plan ------------------------------------------------------------
    def agree_on_round(self, arrival: Arrival, round_: Round | None, job_store: Store,
                       now: float | None = None, plan_seconds: float = ROUND_PLAN_SECONDS
                       ) -> tuple[Plan | None, bytes]:
        """Every agent of the round says what it brings; group rank 0 decides and commits
        (one write and one read per agent, one multi-get for rank 0). (None, b"") when some
        agent of the round does not take part (plain torchrun joined the job): then this
        round starts the torch way. ``round_`` None: a round of one agent.
        ``RoundMemberLostError`` when rank 0 said what it brings but committed no plan
        within ``plan_seconds`` (lost right after the round closed)."""
        detected_at = time.time() if now is None else now
        if round_ is None:
            plan = plan_round([arrival], self.address, detected_at=detected_at)
            raw = take_over(job_store, COMMITTED_KEY, plan)
            return Plan.decode(raw), raw
        store = round_.store
        keys = [f"{ROUND_PREFIX}/arrival/{r}" for r in range(round_.size)]
        store.set(keys[round_.rank], arrival.encode())
        if round_.rank == 0:
            began, suspect = time.monotonic(), round_.suspect or (lambda ranks: False)
            missing = waits.wait_for_arrivals(store, keys, MIXED_ROUND_SECONDS, LOST_KEY,
                                        lambda m: set(m) <= round_.ours and suspect(m))
            if missing and set(missing) <= round_.ours:
                lost = waits.marked_lost(store, LOST_KEY) or missing
                waits.mark_lost(store, LOST_KEY, lost)
                commit_plan(store, COMMITTED_KEY, b"", NEXT_ROUND)
                raise RoundMemberLostError(lost, round_.size,
                                           waits.waited(began, MIXED_ROUND_SECONDS),
                                           "say what they bring")
            if missing:
                raw = commit_plan(store, COMMITTED_KEY, b"", STOCK_ROUND)
            else:
                try:
                    plan = plan_round([Arrival.decode(r) for r in store.multi_get(keys)],
                                      self.address, detected_at=detected_at)
                    raw = take_over(job_store, COMMITTED_KEY, plan)
                    raw = commit_plan(store, COMMITTED_KEY, b"", raw)
                except (RuntimeError, TimeoutError):
                    raw = commit_plan(store, COMMITTED_KEY, b"", STOCK_ROUND)
        else:
            try:
                store.wait([keys[0]], timedelta(seconds=MIXED_ROUND_SECONDS))
            except (RuntimeError, TimeoutError):
                raw = STOCK_ROUND  # group rank 0 is not ours: it decides nothing
            else:
                began = time.monotonic()
                if not waits.wait_for_plan(store, COMMITTED_KEY, plan_seconds, keys, LOST_KEY,
                                     round_.suspect):
                    raise RoundMemberLostError([0], round_.size, waits.waited(began, plan_seconds),
                                               "commit the round's plan")
                raw = store.get(COMMITTED_KEY)
                if raw == NEXT_ROUND:  # whom rank 0 missed (never itself: it came late)
                    raise RoundMemberLostError([r for r in waits.marked_lost(store, LOST_KEY)
                                                or [] if r != round_.rank], round_.size,
                                               MIXED_ROUND_SECONDS, "say what they bring")
        if raw == STOCK_ROUND:
            log.warning("an agent of this rendezvous round is not elastic-train run's (plain "
                        "torchrun?): this round starts every worker the torch way, from the "
                        "newest checkpoint")
            return None, b""
        return Plan.decode(raw), bytes(raw)

    # ---- leaving a world -------------------------------------------------------------------
    def leave(self) -> set[str]:
        """Tell the other members of ``self.plan`` that this agent leaves its world (it takes
        torch's restart path and comes back through a rendezvous round); the members told.
        Bounded as every call to a peer (live/peers.py), never waiting for a suspect."""
        plan = self.plan
        if plan is None:
            return set()
        others = [a for a in plan.agents if a != self.address]
        if not others:
            return set()
        return self.peers.tell_all(others, leaving_key(self.address), str(plan.generation),
                                   abandon=self.suspects)

    def leavers(self, among: Iterable[str] | None = None) -> set[str]:
        """Members (of ``among``; default: every other member of ``self.plan``) that said
        they leave this agent's generation or a newer one (an older word is stale: that
        agent came back since)."""
        plan = self.plan
        if plan is None:
            return set()
        agents = [a for a in plan.agents if a != self.address] if among is None else among
        gone = set()
        for agent in agents:
            raw = local_value(self.node_store, leaving_key(agent))
            with contextlib.suppress(ValueError):
                if raw is not None and int(raw) >= plan.generation:
                    gone.add(agent)
        return gone

    # ---- re-forming within a round ---------------------------------------------------------
    def notice(self) -> Notice | None:
        """A peer's call to re-form, when it asks for a generation not handled yet."""
        assert self.plan is not None
        raw = local_value(self.node_store, NOTICE_KEY)
        if raw is None:
            return None
        notice = Notice.decode(raw)
        if notice.generation <= max(self.plan.generation, self.noticed):
            return None
        return notice

    def target(self, notice: Notice | None, silent: Iterable[str] = ()) -> tuple[str, int]:
        """(Who coordinates, which generation): the caller of ``notice`` (handled from now
        on) unless it is ``silent``, else this agent, the generation after its own."""
        assert self.plan is not None
        if notice is not None and notice.coordinator not in set(silent):
            self.noticed = notice.generation
            return notice.coordinator, notice.generation
        return self.address, self.plan.generation + 1

    def reform(self, job_store: Store, coordinator: str, generation: int, arrival: Arrival,
               detected_at: float, silent: Iterable[str] = ()) -> Outcome:
        """Re-form the world of ``self.plan`` as ``generation``, coordinated by
        ``coordinator`` (this agent, or the peer whose call it follows); the outcome. When
        the coordinator followed is gone, this agent coordinates the generation after."""
        outcome: Outcome = None
        for _ in range(REFORM_ATTEMPTS):
            if coordinator == self.address:
                outcome = self.coordinate(job_store, generation, arrival, detected_at, silent)
            else:
                outcome = self.follow(coordinator, generation, arrival)
            if isinstance(outcome, tuple) or outcome in (UNCOMMITTED, RESTART):
                return outcome
            # the coordinator is gone: this agent coordinates the next generation
            coordinator, generation = self.address, generation + 1
        return outcome

    def coordinate(self, job_store: Store, generation: int, arrival: Arrival,
                   detected_at: float, silent: Iterable[str] = ()) -> Outcome:
        """Call the members of ``self.plan`` to generation ``generation`` (not the
        ``silent`` ones: they are lost), take those that come within ``arrive_seconds``
        (an agent that died refuses the call at once), commit the plan. RESTART when none
        holds the state; None when another coordinator's call came first and it is gone."""
        base = self.plan
        assert base is not None
        silent = set(silent)
        members = [a for a in base.agents if a != self.address and a not in silent]
        called = self.peers.tell_all(members, NOTICE_KEY,
                                     Notice(generation, self.address).encode(),
                                     abandon=self.suspects, keep=preferred_call)
        log.info("coordinating generation %d: called %s of %s (left out: %s)", generation,
                 sorted(called), members, sorted(silent))
        arrivals = {self.address: arrival}
        deadline = time.monotonic() + self.arrive_seconds
        while called - arrivals.keys() and time.monotonic() < deadline:
            silenced = (called - arrivals.keys()) & set(self.suspects())
            if silenced:  # took the call, then fell silent: lost
                log.warning("the agent(s) %s took the call to generation %d and fell "
                            "silent: the world re-forms without them",
                            ", ".join(sorted(silenced)), generation)
                called -= silenced
            gone = self.leavers(called - arrivals.keys())
            if gone:  # took the call, then said it leaves (torch's restart path)
                log.warning("the agent(s) %s left the world (torch's restart path): "
                            "generation %d re-forms without them", ", ".join(sorted(gone)),
                            generation)
                called -= gone
            for agent in called - arrivals.keys():
                raw = local_value(self.node_store, arrival_key(generation, agent))
                if raw is not None:
                    arrivals[agent] = Arrival.decode(raw)
            rival = self.notice()
            if rival is not None and rival.generation >= generation \
                    and rival.coordinator < self.address:
                # two agents called at once: the one with the smaller id coordinates, and
                # the members that arrived here follow it too
                log.info("generation %d: %s called too and coordinates; following it",
                         generation, rival.coordinator)
                self.node_store.set(plan_key(generation), REDIRECT + rival.encode().encode())
                return self.follow(rival.coordinator, rival.generation, arrival)
            time.sleep(0.005)
        log.info("generation %d: %s arrived of %s called", generation,
                 sorted(set(arrivals) - {self.address}), sorted(called))
        plan = plan_reformation(base, arrivals, self.address, generation=generation,
                                detected_at=detected_at)
        if plan is not None and len(plan.members) < self.min_nodes:
            log.warning("%d node(s) left, fewer than the job's minimum (--nnodes %d:...): "
                        "the world is not re-formed in place; every node restarts from the "
                        "newest checkpoint once enough nodes are there", len(plan.members),
                        self.min_nodes)
            plan = None
        if plan is None:
            self.node_store.set(plan_key(generation), RESTART)
            return RESTART
        try:
            raw = self.commit(job_store, plan.encode())
        except Exception as exc:  # the rendezvous' store unreachable: cut off from it
            log.warning("could not commit generation %d (%s: %s): this node may be cut off "
                        "from the others; it restarts its workers and joins again",
                        generation, type(exc).__name__, str(exc).splitlines()[0][:200])
            self.node_store.set(plan_key(generation), RESTART)
            return UNCOMMITTED
        self.node_store.set(plan_key(generation), raw)
        return Plan.decode(raw), raw

    def commit(self, job_store: Store, raw: bytes) -> bytes:
        """Swap the job's plan from the one this agent applies to ``raw``; what is
        committed now (another's plan if another agent, or a newer world, was first)."""
        return self.bounded(lambda: commit_plan(job_store, COMMITTED_KEY, self.plan_raw, raw))

    def follow(self, coordinator: str, generation: int, arrival: Arrival,
               hops: int = REFORM_ATTEMPTS) -> Outcome:
        """Arrive at ``coordinator``'s call; its plan (RESTART, or None if it is gone). A
        coordinator that yielded to a rival sends this member on to the rival."""
        log.info("generation %d: following %s", generation, coordinator)
        if not self.peers.tell(coordinator, arrival_key(generation, self.address),
                               arrival.encode()):
            return None
        raw = self.peers.read(coordinator, plan_key(generation), self.follow_seconds)
        if raw is not None and raw.startswith(REDIRECT):
            if hops <= 0:
                return None
            winner = Notice.decode(raw[len(REDIRECT):])
            return self.follow(winner.coordinator, winner.generation, arrival, hops - 1)
        if raw is None or raw == RESTART:
            return raw
        return Plan.decode(raw), raw


def lost_members(plan: Plan, base: Plan) -> Sequence[str]:
    """The rendezvous nodes of the members of ``base`` that ``plan`` lost."""
    return [m.rdzv_node for m in plan.lost_from(base)]
