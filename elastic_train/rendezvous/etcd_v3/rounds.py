"""The rules of one rendezvous round, apart from etcd: where its keys live, when it closes,
and the rank order of its members.

Keys of a job, under ``<key_prefix>/<run_id>/``::

    latest                          the newest closed round's number
    closed                          the whole rendezvous is over (the job ended)
    round/<r>/node/<node>           one per node that joined round r, on that node's lease
    round/<r>/ctl/coordinator       the node that closes round r, on its lease
    round/<r>/ctl/world             round r's members in rank order (written once, by a txn)
    round/<r>/ctl/stalled           a member of the world before fell silent while round r
                                    formed: its workers wait in a collective (no last call)
    store/...                       the c10d store the agents share (store.py)

A round closes when it has ``max_nodes`` members, or when it has had at least
``min_nodes`` for ``last_call`` seconds (torch's rule), and never while a member of the
previous round's world is alive (its key there on its lease) and not in this one: that
world runs, its members come to this round when they see it open, and a round closed
without them would be a second world of the same job (torch's rendezvous too keeps a late
node waiting until the participants come). A round marked ``stalled`` (a member of the
world before fell silent meanwhile, and the others' workers wait for it in a collective)
closes as soon as it has ``min_nodes`` and awaits nobody: no last call. Ranks are stable:
the members of the previous round keep their order, newcomers follow in the order they
joined.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundKeys:
    """The etcd keys of one job's rendezvous."""

    base: str

    @classmethod
    def of(cls, key_prefix: str, run_id: str) -> RoundKeys:
        return cls(f"{key_prefix.rstrip('/')}/{run_id}")

    @property
    def latest(self) -> str:
        return f"{self.base}/latest"

    @property
    def closed(self) -> str:
        return f"{self.base}/closed"

    @property
    def rounds(self) -> str:
        """The prefix of every round (what a member's monitor watches)."""
        return f"{self.base}/round/"

    @property
    def store(self) -> str:
        return f"{self.base}/store/"

    def round(self, number: int) -> str:
        return f"{self.base}/round/{number:08d}/"

    def nodes(self, number: int) -> str:
        return f"{self.round(number)}node/"

    def node(self, number: int, node: str) -> str:
        return f"{self.nodes(number)}{node}"

    def ctl(self, number: int) -> str:
        return f"{self.round(number)}ctl/"

    def coordinator(self, number: int) -> str:
        return f"{self.ctl(number)}coordinator"

    def world(self, number: int) -> str:
        return f"{self.ctl(number)}world"

    def stalled(self, number: int) -> str:
        return f"{self.ctl(number)}stalled"

    def parse_node_key(self, key: str) -> tuple[int, str] | None:
        """(round, node) of a ``round/<r>/node/<node>`` key, else None."""
        rest = key[len(self.rounds):] if key.startswith(self.rounds) else None
        if rest is None:
            return None
        number, sep, tail = rest.partition("/node/")
        if not sep or not number.isdigit() or not tail:
            return None
        return int(number), tail


@dataclass(frozen=True)
class World:
    """A closed round: its number and its members in rank order."""

    round: int
    members: tuple[str, ...]

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "members": list(self.members)}).encode()

    @classmethod
    def decode(cls, value: bytes, where: str) -> World:
        from torch.distributed.elastic.rendezvous.api import RendezvousStateError

        try:
            raw = json.loads(value)
            return cls(int(raw["round"]), tuple(str(m) for m in raw["members"]))
        except (ValueError, KeyError, TypeError):
            raise RendezvousStateError(
                f"the rendezvous record at {where} is corrupt or was not written by the "
                "etcd-v3 backend: delete the job's keys or use a new --rdzv-id") from None


def rank_order(joined: Mapping[str, int], previous: Sequence[str] = ()) -> tuple[str, ...]:
    """Members in rank order: the previous round's, in their order, then the newcomers by
    the revision they joined at (node id breaks ties)."""
    kept = [node for node in previous if node in joined]
    seen = set(kept)
    newcomers = sorted((node for node in joined if node not in seen),
                       key=lambda node: (joined[node], node))
    return (*kept, *newcomers)


class RoundTally:
    """The coordinator's view of the round it closes: who is in, and when to close."""

    def __init__(self, min_nodes: int, max_nodes: int, last_call: float) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"min_nodes {min_nodes} and max_nodes {max_nodes}: need "
                             "1 <= min <= max")
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.last_call = last_call
        self.members: dict[str, int] = {}  # node -> the revision it joined at
        self._min_since: float | None = None
        self._expected: set[str] = set()
        """Members of the previous round's world still alive there (``expect``)."""
        self._stalled = False

    def expect(self, alive: set[str]) -> None:
        """The previous round's world members that are still alive: the round waits for
        each of them to join, or to be gone (``previous_gone``), before it closes."""
        self._expected = set(alive)

    def previous_gone(self, node: str) -> None:
        """A member of the previous round's world is gone (its key there deleted: it left,
        its lease expired, or the world re-formed without it and said so)."""
        self._expected.discard(node)

    def stall(self) -> None:
        """The previous world's workers wait for a member that fell silent: no last call
        (it would hold them that long)."""
        self._stalled = True

    def awaited(self) -> set[str]:
        """Members of the previous world, alive, that this round still waits for."""
        return self._expected - set(self.members)

    def joined(self, node: str, revision: int, now: float) -> None:
        self.members.setdefault(node, revision)
        self._update(now)

    def left(self, node: str, now: float) -> None:
        self.members.pop(node, None)
        self._update(now)

    def _update(self, now: float) -> None:
        if len(self.members) < self.min_nodes:
            self._min_since = None
        elif self._min_since is None:
            self._min_since = now

    def due(self, now: float) -> bool:
        """Whether the round closes now."""
        if len(self.members) >= self.max_nodes:
            return True
        return not self.awaited() and self.due_but_for_the_previous_world(now)

    def due_but_for_the_previous_world(self, now: float) -> bool:
        """Whether torch's rule alone says close (``max`` nodes, or ``min`` for last call)."""
        if len(self.members) >= self.max_nodes:
            return True
        return self._min_since is not None and (
            self._stalled or now - self._min_since >= self.last_call)

    def wake_at(self) -> float | None:
        """When ``due`` turns true by time alone (None: only a join, or a member of the
        previous world gone, can make it)."""
        if self._min_since is None or self.awaited():
            return None
        return self._min_since + (0.0 if self._stalled else self.last_call)

    def close(self, previous: Sequence[str] = ()) -> tuple[str, ...]:
        """The members in rank order, at most ``max_nodes`` (the earliest joiners)."""
        order = rank_order(self.members, previous)
        if len(order) > self.max_nodes:
            first = set(sorted(self.members, key=lambda n: (self.members[n], n))
                        [:self.max_nodes])
            order = tuple(node for node in order if node in first)
        return order
