"""Worker ranks of a rendezvous round, with a bound on the wait for its members.

Once a round closed, torch's agent (``SimpleElasticAgent._assign_worker_ranks``) has every
member write its role and local world size to the round's store; the round's rank 0 reads
them all, numbers the workers, and writes each member its ranks. Both waits are blocking
store calls bounded only by the store's timeout (60 s on c10d), and on c10d's
``TCPStore`` a blocking call holds the client for its whole length: the rendezvous'
heartbeats, sent through the same client, stop too.

So a member lost right after the round closed (killed before it wrote its role) used to
end the job: the others waited 60 s with no heartbeat, a node that came back meanwhile
took them for dead and formed a world of its own, and every agent then failed with
``DistStoreError`` (the fault campaign, c10d seed 403). Here the same keys and values are
written and read (a round may hold torch's own agents), but each wait polls the keys
within ``MEMBERS_SECONDS``, the client free between polls; a member missing by then raises
``RoundMemberLostError`` and the agent goes into the next round without it
(agent/live_agent.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from elastic_train.errors import RoundMemberLostError
from elastic_train.live.round_waits import mark_lost, marked_lost, wait_for_keys, waited

log = logging.getLogger(__name__)

ROLE_INFO_PREFIX = "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"
MEMBERS_SECONDS = 10.0
"""How long a member of a closed round waits for the others' roles (rank 0) or for its
ranks (the others). Members leave a closed round within about a second of each other (the
rendezvous is polled every second); a member still missing after this was lost."""
OURS_FIELD = "elastic_train"
"""A field our agents add to torch's role info (torch's reader ignores it)."""
GIVEN_UP_KEY = "elastic_train/ranks_given_up"
"""Written in the round's store by the first member that gives up on its rank assignment
(JSON: the members it missed): every other member's wait then ends at once, not at its
bound. A member whose failure detector does not watch the lost one (a node that joins)
waited its whole bound for ranks the round's rank 0 was never going to write (the fault
campaign, c10d seed 863: 10 s, and the next round waited for it meanwhile)."""


@dataclass(frozen=True)
class RoundRanks:
    """This member's first worker ranks and the sizes they belong to."""

    base_global_rank: int
    global_world_size: int
    base_role_rank: int
    role_world_size: int
    ours: tuple[int, ...] = ()
    """(Rank 0 only) the round's members whose role carries ``OURS_FIELD``: elastic-train
    run's agents, which say what they bring next (live/coordination.py); one of them missing
    there was lost, not a plain torchrun agent."""


def _nobody(group_ranks: list[int]) -> bool:
    return False


def assign_round_ranks(store: dist.Store, group_rank: int, group_world_size: int, role: str,
                       local_world_size: int,
                       silent: Callable[[list[int]], bool] | None = None,
                       seconds: float = MEMBERS_SECONDS) -> RoundRanks:
    """torch's rank assignment of a closed round (same keys, same values), each wait
    bounded by ``seconds``; ``RoundMemberLostError`` names the members still missing
    (rank 0; the others name rank 0 when it is silent, else nobody). ``silent(ranks)``:
    whether the failure detector suspects one of these members; a wait for a suspect ends
    at once (the fault campaign, etcd-v3 seed 810: a node frozen right after the round
    closed held the others 9 s here)."""
    silent = silent or _nobody
    began = time.monotonic()
    deadline = began + seconds
    store.set(f"{ROLE_INFO_PREFIX}{group_rank}", json.dumps(
        {"role": role, "rank": group_rank, "local_world_size": local_world_size,
         OURS_FIELD: 1}).encode())
    ours: tuple[int, ...] = ()
    if group_rank == 0:
        keys = [f"{ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)]

        def ranks(of: list[str]) -> list[int]:
            return [int(k[len(ROLE_INFO_PREFIX):]) for k in of]

        missing = wait_for_keys(store, keys, deadline,
                            lambda left: _all_lost(store, ranks(left), silent))
        if missing:
            lost = marked_lost(store, GIVEN_UP_KEY) or ranks(missing)
            mark_lost(store, GIVEN_UP_KEY, lost)
            raise RoundMemberLostError(lost, group_world_size, waited(began, seconds))
        infos = store.multi_get(keys)
        store.multi_set(*_assigned(infos))
        ours = tuple(i for i, info in enumerate(infos) if json.loads(info).get(OURS_FIELD))
    mine = f"{ASSIGNED_RANKS_PREFIX}{group_rank}"
    if wait_for_keys(store, [mine], deadline,
                 lambda _: silent([0]) or marked_lost(store, GIVEN_UP_KEY) is not None):
        lost = marked_lost(store, GIVEN_UP_KEY) or ([0] if silent([0]) else [])
        mark_lost(store, GIVEN_UP_KEY, lost)
        raise RoundMemberLostError(lost, group_world_size, waited(began, seconds))
    return RoundRanks(*json.loads(store.get(mine)), ours=ours)


def _all_lost(store: dist.Store, missing: list[int], silent: Callable[[list[int]], bool]
              ) -> bool:
    """Whether every member of ``missing`` is lost: suspected by the failure detector, or
    given up on by another member. One that nobody suspects is waited for (it may only be
    slow: naming it would take it out of the next round too)."""
    given_up = set(marked_lost(store, GIVEN_UP_KEY) or ())
    return all(rank in given_up or silent([rank]) for rank in missing)


def _assigned(infos: list[bytes]) -> tuple[list[str], list[str]]:
    """Rank 0's numbering of every member's workers, as torch's agent writes it."""
    roles = [json.loads(info) for info in infos]
    role_sizes: dict[str, int] = defaultdict(int)
    for info in roles:
        role_sizes[info["role"]] += info["local_world_size"]
    global_size = sum(role_sizes.values())
    keys, values = [], []
    base, role_ranks = 0, defaultdict(int)
    for i, info in enumerate(roles):
        keys.append(f"{ASSIGNED_RANKS_PREFIX}{i}")
        values.append(json.dumps([base, global_size, role_ranks[info["role"]],
                                  role_sizes[info["role"]]]))
        base += info["local_world_size"]
        role_ranks[info["role"]] += info["local_world_size"]
    return keys, values


ROUND_ATTEMPTS = 10
"""Rounds in a row an agent goes into when each loses a member right after it closed,
before it gives up (each costs ``MEMBERS_SECONDS``)."""


def rendezvous_until_ranked(join: Callable[[], None], lost: Callable[[list[int]], None],
                            attempts: int = ROUND_ATTEMPTS) -> None:
    """``join()`` (a rendezvous round, then the ranks of its workers) until a round keeps
    every member through its rank assignment: after a ``RoundMemberLostError``,
    ``lost(group_ranks)`` where rank 0 named the members it missed, then the next round.
    Raises the last error after ``attempts`` rounds."""
    for attempt in range(1, attempts + 1):
        try:
            join()
            return
        except RoundMemberLostError as exc:
            if attempt == attempts:
                raise
            log.warning("%s: this node goes into the next rendezvous round", exc)
            if exc.missing:
                lost(exc.missing)
