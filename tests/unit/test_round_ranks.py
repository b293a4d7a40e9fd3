"""agent/round_ranks.py on a real TCPStore: the ranks of a closed round as torch numbers
them (torch's own agent can sit in the same round), and a member lost right after the round
closed costs a bounded wait that leaves the store's client free, not 60 s of a blocked
client (the fault campaign, c10d seed 403)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

from elastic_train.agent.round_ranks import (
    RoundRanks,
    assign_round_ranks,
    rendezvous_until_ranked,
)
from elastic_train.errors import RoundMemberLostError


def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def client(of: dist.TCPStore, prefix: str = "round.1") -> dist.Store:
    """A member's view of the round: a client of its own, under the round's prefix."""
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", of.port, is_master=False,
                                                  timeout=timedelta(seconds=60)))


def in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return results


def torch_member(store: Any, group_rank: int, members: int, local_world_size: int
                 ) -> list[Any]:
    """torch's own agent's rank assignment, as a member of the round (plain torchrun)."""
    spec = WorkerSpec(role="trainer", local_world_size=local_world_size,
                      rdzv_handler=None, entrypoint="x")  # type: ignore[arg-type]
    return SimpleElasticAgent._assign_worker_ranks(  # type: ignore[misc]
        object(), client(store), group_rank, members, spec)  # type: ignore[arg-type]


def test_members_of_a_round_get_torch_s_numbering_by_role_and_local_world_size() -> None:
    store = server()
    sizes = [2, 1, 3]
    got = in_threads([lambda i=i: assign_round_ranks(client(store), i, 3, "trainer",
                                                     sizes[i], seconds=10.0)
                      for i in range(3)])
    # rank 0 also learns that every member is ours (each says what it brings next)
    assert got == [RoundRanks(0, 6, 0, 6, ours=(0, 1, 2)), RoundRanks(2, 6, 2, 6),
                   RoundRanks(3, 6, 3, 6)]


def test_torch_s_own_agent_and_ours_number_the_same_round_together() -> None:
    """Same keys, same values: a round may hold a plain torchrun agent (as rank 0 here)."""
    store = server()

    theirs, ours = in_threads([lambda: torch_member(store, 0, 2, 2), lambda: assign_round_ranks(
        client(store), 1, 2, "trainer", 3, seconds=10.0)])
    assert [(w.global_rank, w.world_size) for w in theirs] == [(0, 5), (1, 5)]
    assert ours == RoundRanks(2, 5, 2, 5)


def test_our_rank_0_tells_a_plain_torchrun_member_from_ours() -> None:
    """A member that does not say what it brings after the ranks is a lost one if it is
    ours, a plain torchrun agent if not (live/coordination.agree_on_round): rank 0 learns
    which is which from the same role info torch reads (its reader ignores the mark)."""
    store = server()

    first, theirs, last = in_threads([
        lambda: assign_round_ranks(client(store), 0, 3, "trainer", 2, seconds=10.0),
        lambda: torch_member(store, 1, 3, 1),
        lambda: assign_round_ranks(client(store), 2, 3, "trainer", 1, seconds=10.0)])
    assert first == RoundRanks(0, 4, 0, 4, ours=(0, 2)) and last == RoundRanks(3, 4, 3, 4)
    assert [(w.global_rank, w.world_size) for w in theirs] == [(2, 4)]


def test_a_member_lost_right_after_the_round_closed_is_named_by_rank_0_within_the_bound(
        ) -> None:
    store = server()
    member = client(store)
    heartbeats: list[float] = []
    done = threading.Event()

    def heartbeat() -> None:  # the rendezvous' heartbeat thread, on the same client
        while not done.is_set():
            began = time.monotonic()
            member.set("heartbeat", str(began))
            heartbeats.append(time.monotonic() - began)
            done.wait(0.05)

    beating = threading.Thread(target=heartbeat)
    began = time.monotonic()
    rank_1 = threading.Thread(target=lambda: client(store).set(
        "torchelastic/role_info/1", b'{"role": "r", "rank": 1, "local_world_size": 1}'))
    rank_1.start()
    beating.start()
    try:
        with pytest.raises(RoundMemberLostError) as caught:
            assign_round_ranks(member, 0, 3, "r", 1, seconds=1.5)
    finally:
        done.set()
        beating.join(10)
        rank_1.join(10)
    took = time.monotonic() - began
    assert caught.value.missing == [2]
    assert str(caught.value) == ("member(s) [2] of a rendezvous round of 3 did not take "
                                 "their worker ranks within 1.5 s (lost right after the "
                                 "round closed)")
    assert 1.5 <= took < 3.0, took
    assert len(heartbeats) > 10 and max(heartbeats) < 0.5, heartbeats


def test_a_member_whose_rank_0_was_lost_gives_up_within_the_bound_naming_no_one() -> None:
    store = server()
    began = time.monotonic()
    with pytest.raises(RoundMemberLostError) as caught:
        assign_round_ranks(client(store), 1, 2, "r", 1, seconds=1.0)
    assert caught.value.missing == []
    assert "did not assign this node's worker ranks within 1 s" in str(caught.value)
    assert time.monotonic() - began < 3.0


def test_the_next_round_follows_a_lost_member_and_the_last_error_ends_the_tries() -> None:
    errors = [RoundMemberLostError([2], 3, 10.0), RoundMemberLostError([], 3, 10.0)]
    lost: list[list[int]] = []
    joins: list[int] = []

    def join() -> None:
        joins.append(1)
        if errors:
            raise errors.pop(0)

    rendezvous_until_ranked(join, lost.append)
    assert len(joins) == 3 and lost == [[2]]

    def never() -> None:
        raise RoundMemberLostError([1], 2, 10.0)

    with pytest.raises(RoundMemberLostError):
        rendezvous_until_ranked(never, lost.append, attempts=3)
    assert lost == [[2], [1], [1]]


def test_rank_0_names_a_silent_member_at_once_instead_of_waiting_the_bound() -> None:
    """The fault campaign, etcd-v3 seed 810: a node frozen right after the round closed;
    the failure detector suspected it 1.4 s in, but the others waited for its role until
    it thawed, 9.2 s. A wait for a member the detector suspects ends at once."""
    master = server()
    store = client(master)
    store.set("torchelastic/role_info/1", b'{"role": "r", "rank": 1, "local_world_size": 1}')
    asked: list[list[int]] = []

    def silent(ranks: list[int]) -> bool:
        asked.append(ranks)
        return len(asked) >= 3 and 2 in ranks    # suspected from the third look on

    began = time.monotonic()
    with pytest.raises(RoundMemberLostError) as caught:
        assign_round_ranks(store, 0, 3, "r", 1, silent, seconds=30.0)
    assert caught.value.missing == [2] and time.monotonic() - began < 3.0
    assert asked[0] == [2]                        # asked of the missing member only
    assert "within 30 s" not in str(caught.value)


def test_a_member_whose_rank_0_is_silent_names_it_at_once() -> None:
    master = server()
    began = time.monotonic()
    with pytest.raises(RoundMemberLostError) as caught:
        assign_round_ranks(client(master), 1, 2, "r", 1, lambda r: r == [0], seconds=30.0)
    assert caught.value.missing == [0] and time.monotonic() - began < 3.0


def test_when_rank_0_gives_up_on_a_silent_member_the_others_stop_waiting_at_once() -> None:
    """The fault campaign, c10d seed 863: node C froze as the round it formed with A (rank
    0, whose detector watches C) and a joining node B closed. A gave up on C's role at once
    and went into the next round; B, whose detector does not watch C, waited its whole
    10 s for ranks A would never write, and the next round waited for B meanwhile (7.7 s
    to the next step). Rank 0's word that it gave up ends B's wait, naming C."""
    master = server()
    began = time.monotonic()
    rank_0, rank_1 = in_threads([
        lambda: assign_round_ranks(client(master), 0, 3, "r", 1, lambda r: 2 in r,
                                   seconds=30.0),
        lambda: assign_round_ranks(client(master), 1, 3, "r", 1, seconds=30.0)])
    assert isinstance(rank_0, RoundMemberLostError) and rank_0.missing == [2]
    assert isinstance(rank_1, RoundMemberLostError) and rank_1.missing == [2], rank_1
    assert time.monotonic() - began < 3.0          # 30 s for rank 1 before
    # a member that gives up because rank 0 is silent tells the others likewise
    other = server()
    alone, follower = in_threads([
        lambda: assign_round_ranks(client(other), 1, 3, "r", 1, lambda r: r == [0],
                                   seconds=30.0),
        lambda: assign_round_ranks(client(other), 2, 3, "r", 1, seconds=30.0)])
    assert isinstance(alone, RoundMemberLostError) and alone.missing == [0]
    assert isinstance(follower, RoundMemberLostError) and follower.missing == [0]


def test_a_slow_member_is_not_named_with_the_silent_one() -> None:
    """Rank 0's detector suspects member 2; member 1 is alive but takes a moment to write
    its role: only member 2 is named (named members leave the next round too)."""
    master = server()
    late = threading.Timer(0.8, lambda: client(master).set(
        "torchelastic/role_info/1", b'{"role": "r", "rank": 1, "local_world_size": 1}'))
    late.start()
    try:
        with pytest.raises(RoundMemberLostError) as caught:
            assign_round_ranks(client(master), 0, 3, "r", 1, lambda ranks: 2 in ranks,
                               seconds=30.0)
    finally:
        late.join(5)
    assert caught.value.missing == [2]
