"""Live recovery across nodes, the pure part: who is in the next generation of the world.

Every agent of a job (one per node) says what it brings to a re-formation in an ``Arrival``:
its workers, whether they hold the training state (alive, restored, in the loop), and its
place in the generation before. A ``Plan`` is what they agree on: the generation's members
(agents) in rank order, the world size, where its process group forms, what was lost. Plans
are committed by compare-and-swap of one key in the rendezvous' store (live/coordination.py), from
the plan they replace, so that two agents deciding at once, or a partitioned minority
deciding alone, cannot both commit: a stale plan's swap fails.

Two ways to a plan:

- ``plan_round``: after a rendezvous round (the start, a node joining, torch's restart
  path), every agent of the round arrives; the state lives on if any of them holds it
  (``live``), else every worker starts from the newest checkpoint (``fresh``).
- ``plan_reformation``: within a round, after a worker or a whole node was lost; the
  members of the previous plan that did not come back are gone.

Ranks are stable: members keep the order of the generation before, newcomers follow in the
order they arrived. The step of a plan's world is never decided here: the workers agree on
it when they exchange the state (runtime.WorkerRuntime.share_state).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

LIVE = "live"
FRESH = "fresh"


@dataclass(frozen=True)
class Arrival:
    """One agent's part in a re-formation.

    ``agent``: its id, the HOST:PORT of the store it keeps for its workers (unique per agent
    process; peers reach it there); ``workers``: its local world size; ``alive``: its local
    ranks whose processes hold the state now (empty: none does); ``first_rank``: the global
    rank of its local rank 0 in the generation it was in (None: it was in none);
    ``generation``: the newest generation it knows (-1: none) and ``world_size`` that
    generation's; ``writer``: its worker that was rank 0 (the checkpoint writer) is alive;
    ``rdzv_node``: its node in the rendezvous (rendezvous/forget.py; "": none known);
    ``beat``: HOST:PORT where its agent answers the failure detector's pings
    (agent/failure_detector.py; "": it does not).
    """

    agent: str
    workers: int
    alive: tuple[int, ...] = ()
    first_rank: int | None = None
    generation: int = -1
    world_size: int | None = None
    writer: bool = False
    rdzv_node: str = ""
    beat: str = ""

    @property
    def holds_state(self) -> bool:
        return bool(self.alive)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> Arrival:
        raw = json.loads(text)
        return cls(str(raw["agent"]), int(raw["workers"]), tuple(raw.get("alive", ())),
                   raw.get("first_rank"), int(raw.get("generation", -1)),
                   raw.get("world_size"), bool(raw.get("writer", False)),
                   str(raw.get("rdzv_node", "")), str(raw.get("beat", "")))


@dataclass(frozen=True)
class Member:
    """One agent of a generation: its id, how many workers it runs, its node in the
    rendezvous (so that the others can remove it from there once it is lost) and where it
    answers the failure detector (so that the others notice when it falls silent)."""

    agent: str
    workers: int
    rdzv_node: str = ""
    beat: str = ""


@dataclass(frozen=True)
class Plan:
    """A generation of the world, as every agent of it applies it.

    ``kind``: ``live`` (the state comes from the workers that hold it) or ``fresh`` (every
    worker starts from the newest checkpoint); ``group_store``: HOST:PORT of the store the
    generation's process group forms on (its coordinator's); ``cause``: why it formed;
    ``lost``: agents of the generation before that are not in this one; ``failed_ranks``:
    ranks of the generation before whose workers were lost; ``started``: workers that start
    into this generation without the state (they receive it); ``claim_epoch``: the writer of
    the generation before is gone, so the new rank 0 claims a new writer epoch
    (checkpoint/fence.py) that fences whatever that writer still commits.
    """

    generation: int
    kind: str
    members: tuple[Member, ...]
    group_store: str
    cause: str
    lost: tuple[str, ...] = ()
    failed_ranks: tuple[int, ...] = ()
    previous_world_size: int | None = None
    started: int = 0
    claim_epoch: bool = False
    detected_at: float | None = None
    kept: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Per agent, its local ranks that keep their process (the others start again)."""

    @property
    def world_size(self) -> int:
        return sum(m.workers for m in self.members)

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(m.agent for m in self.members)

    def lost_from(self, previous: Plan) -> tuple[Member, ...]:
        """The members of ``previous`` that this plan lost."""
        return tuple(m for m in previous.members if m.agent in self.lost)

    def node_index(self, agent: str) -> int:
        """The agent's place among the members (its workers' GROUP_RANK)."""
        return self.agents.index(agent)

    def first_rank(self, agent: str) -> int:
        index = self.node_index(agent)
        return sum(m.workers for m in self.members[:index])

    def ranks(self, agent: str) -> dict[int, int]:
        """{local rank: global rank} of the agent's workers."""
        base = self.first_rank(agent)
        return {lr: base + lr for lr in range(self.members[self.node_index(agent)].workers)}

    def keeps(self, agent: str) -> tuple[int, ...]:
        """The agent's local ranks whose processes go on into this generation."""
        return tuple(self.kept.get(agent, ()))

    def same_world(self, other: Plan | None) -> bool:
        """Whether this plan's world is ``other``'s, worker for worker (nothing to re-form)."""
        return (other is not None and self.kind == LIVE and self.members == other.members
                and not self.started)

    def encode(self) -> bytes:
        raw = asdict(self)
        raw["kept"] = {k: list(v) for k, v in self.kept.items()}
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: str | bytes) -> Plan:
        raw = json.loads(data)
        return cls(
            generation=int(raw["generation"]), kind=str(raw["kind"]),
            members=tuple(Member(str(m["agent"]), int(m["workers"]), str(m.get("rdzv_node", "")),
                                 str(m.get("beat", ""))) for m in raw["members"]),
            group_store=str(raw["group_store"]), cause=str(raw["cause"]),
            lost=tuple(raw.get("lost", ())), failed_ranks=tuple(raw.get("failed_ranks", ())),
            previous_world_size=raw.get("previous_world_size"),
            started=int(raw.get("started", 0)), claim_epoch=bool(raw.get("claim_epoch")),
            detected_at=raw.get("detected_at"),
            kept={str(k): tuple(v) for k, v in (raw.get("kept") or {}).items()})


def _in_rank_order(arrivals: Sequence[Arrival]) -> list[Arrival]:
    """Members of the generation before in their order, then newcomers as they arrived."""
    known = sorted((a for a in arrivals if a.holds_state and a.first_rank is not None),
                   key=lambda a: a.first_rank)  # type: ignore[arg-type,return-value]
    seen = {a.agent for a in known}
    return [*known, *(a for a in arrivals if a.agent not in seen)]


def _kept(arrivals: Iterable[Arrival]) -> dict[str, tuple[int, ...]]:
    return {a.agent: tuple(a.alive) for a in arrivals if a.alive}


def _without_stale_holders(arrivals: Sequence[Arrival]) -> list[Arrival]:
    """``arrivals``, where workers that hold the state of an older generation than the
    newest held count as holding nothing: their world moved on without them (a node cut
    off or frozen while the others re-formed), so their state is stale, and their workers
    may still wait in a collective of that world. They start again and receive the state."""
    newest = max((a.generation for a in arrivals if a.holds_state), default=-1)
    return [dataclasses.replace(a, alive=(), writer=False)
            if a.holds_state and a.generation < newest else a for a in arrivals]


def plan_round(arrivals: Sequence[Arrival], group_store: str, *, detected_at: float | None = None
               ) -> Plan:
    """The first generation of a rendezvous round; ``arrivals`` in the round's rank order.

    ``live`` when some agent holds the state: its workers go on, every other worker starts
    without it and receives it (workers holding an older generation's state start again
    too); ``fresh`` when none does. The generation is one past the
    newest any agent knows.
    """
    generation = max((a.generation for a in arrivals), default=-1) + 1
    ordered = _in_rank_order(_without_stale_holders(arrivals))
    members = tuple(Member(a.agent, a.workers, a.rdzv_node, a.beat) for a in ordered)
    holders = [a for a in ordered if a.holds_state]
    if not holders:
        return Plan(generation, FRESH, members, group_store, "start",
                    started=sum(m.workers for m in members), detected_at=detected_at)
    started = sum(a.workers - len(a.alive) for a in ordered)
    return Plan(generation, LIVE, members, group_store,
                "node joined" if any(not a.holds_state for a in ordered) else "new round",
                started=started, claim_epoch=not any(a.writer for a in ordered),
                detected_at=detected_at, kept=_kept(ordered),
                previous_world_size=max(a.world_size or 0 for a in holders) or None)


def plan_reformation(previous: Plan, arrivals: Mapping[str, Arrival], group_store: str, *,
                     generation: int | None = None, detected_at: float | None = None
                     ) -> Plan | None:
    """Generation ``generation`` (default: the one after ``previous``) after ``previous``
    lost workers or nodes: the members of ``previous`` that arrived, in the same order.
    None when none of them holds the state (then only the checkpoint can bring the world
    back: torch's restart path)."""
    members = [m for m in previous.members if m.agent in arrivals]
    lost = tuple(m.agent for m in previous.members if m.agent not in arrivals)
    if not any(arrivals[m.agent].holds_state for m in members):
        return None
    failed: list[int] = []
    for m in previous.members:
        base = previous.first_rank(m.agent)
        alive = set(arrivals[m.agent].alive) if m.agent in arrivals else set()
        failed.extend(base + lr for lr in range(m.workers) if lr not in alive)
    started = sum(m.workers - len(arrivals[m.agent].alive) for m in members)
    cause = "node lost" if lost else "worker lost" if failed else "collective failed"
    writer_alive = any(arrivals[m.agent].writer for m in members)
    return Plan(previous.generation + 1 if generation is None else generation, LIVE,
                tuple(members), group_store, cause,
                lost=lost, failed_ranks=tuple(failed),
                previous_world_size=previous.world_size, started=started,
                claim_epoch=not writer_alive, detected_at=detected_at,
                kept=_kept(arrivals[m.agent] for m in members))
