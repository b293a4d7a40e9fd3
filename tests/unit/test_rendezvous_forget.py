"""Removing lost nodes from torch's dynamic rendezvous (rendezvous/forget.py), on real
handlers over a real TCPStore (the c10d backend): a node that joins after a node was lost
does not wait out the lost node's heartbeat expiry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.etcd_v3.state_key import build_handler
from elastic_train.rendezvous.forget import forget_nodes, rendezvous_node_id
from tests.memory_kv import MemoryKV

RUN_ID = "forget-test"
JOIN_SECONDS = 6
"""A round that waited for the lost node (its heartbeats expire after 10 min) times out."""


@pytest.fixture(params=["c10d", "etcd-v3 state-key"])
def make_handler(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[Callable[[], Any]]:
    """Handlers of one rendezvous: torch's on c10d's backend (a real TCPStore), or etcd-v3's
    ``design=state-key`` (torch's handler, our backend; here on the in-memory KV)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    kv = MemoryKV()
    made: list[DynamicRendezvousHandler] = []

    def make(last_call: float = 0.3) -> DynamicRendezvousHandler:
        if request.param != "c10d":
            options = EtcdV3Options.parse("127.0.0.1:2379", {
                "design": "state-key", "join_timeout": JOIN_SECONDS,
                "last_call_timeout": last_call, "keep_alive_interval": 60,
                "keep_alive_max_attempt": 10})
            handler = build_handler(kv, options, RUN_ID, 2, 3, local_addr="127.0.0.1")
            made.append(handler)
            return handler
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=30))
        handler = DynamicRendezvousHandler.from_backend(
            RUN_ID, client, C10dRendezvousBackend(client, RUN_ID), min_nodes=2, max_nodes=3,
            local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=timedelta(seconds=JOIN_SECONDS),
                                      last_call=timedelta(seconds=last_call)),
            keep_alive_interval=60, keep_alive_max_attempt=10)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler._stop_heartbeats()  # torch's own stop; its threads would outlive the store


def _all_rendezvous(*handlers: Any) -> list[Any]:
    """``next_rendezvous`` of every handler at once; their infos (or errors), in order."""
    results: list[Any] = [None] * len(handlers)

    def run(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_SECONDS + 10)
    assert not any(t.is_alive() for t in threads), "a rendezvous outlived its join timeout"
    return results


def _participants(handler: Any) -> set[str]:
    holder = handler._state_holder
    holder._last_sync_time = -1  # read the backend, not the cache
    holder.sync()
    return {repr(n) for n in holder.state.participants}


def _join_and_wait_seen(c: Any, a: Any) -> tuple[threading.Thread, list[Any]]:
    """``c`` goes into the rendezvous (in a thread); returns once ``a`` sees it waiting
    (what a's agent watches for), bounded by ``JOIN_SECONDS``: the thread, and where its
    result lands."""
    joined: list[Any] = []
    waiting = threading.Thread(target=lambda: joined.extend(_all_rendezvous(c)), daemon=True)
    waiting.start()
    deadline = time.monotonic() + JOIN_SECONDS
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the new node never showed up as waiting"
        time.sleep(0.05)
    return waiting, joined


def _lose_b_then_join_c(make: Callable[[], Any], forget: bool) -> list[Any]:
    a, b = make(), make()
    first = _all_rendezvous(a, b)
    assert [info.world_size for info in first] == [2, 2], first
    assert _participants(a) == {rendezvous_node_id(a), rendezvous_node_id(b)}
    b._stop_heartbeats()  # b is lost: it sends nothing more
    if forget:
        assert forget_nodes(a, [rendezvous_node_id(b)]) == [rendezvous_node_id(b)]
        assert _participants(a) == {rendezvous_node_id(a)}
    c = make()
    waiting, joined = _join_and_wait_seen(c, a)
    if forget:  # a node waiting to join is alive: never removed, also when asked to
        assert forget_nodes(a, [rendezvous_node_id(c)]) == [] and a.num_nodes_waiting() == 1
    again = _all_rendezvous(a)
    waiting.join(JOIN_SECONDS + 10)
    return [*again, *joined]


def test_a_forgotten_node_leaves_the_round_and_a_new_node_joins_at_once(
        make_handler: Callable[[], Any]) -> None:
    infos = _lose_b_then_join_c(make_handler, forget=True)
    assert all(not isinstance(i, Exception) for i in infos), infos
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}


@pytest.mark.parametrize("make_handler", ["c10d"], indirect=True)  # torch's handler: once
def test_without_it_the_join_waits_for_the_lost_nodes_heartbeats(
        make_handler: Callable[[], Any]) -> None:
    """What forget_nodes saves: the round waits for b to expire (here: times out first)."""
    infos = _lose_b_then_join_c(make_handler, forget=False)
    assert all(isinstance(i, RendezvousTimeoutError) for i in infos), infos


def _join_c_while_b_falls_silent(make: Callable[..., Any], leave_out: bool,
                                 last_call: float = 0.3) -> tuple[list[Any], float]:
    """a and b formed a round; c comes; a goes into the next round while b, silent, never
    leaves the last one (frozen, or its cable pulled). ``leave_out``: a's failure detector
    leaves b out, from its own thread, while a waits inside torch's round (a stays).
    Every node's result, and the seconds from a's entry into the round to the end."""
    a, b = make(last_call), make(last_call)
    assert [i.world_size for i in _all_rendezvous(a, b)] == [2, 2]
    b._stop_heartbeats()
    observer = make(last_call)
    waiting, joined = _join_and_wait_seen(make(last_call), a)
    deadline = time.monotonic() + JOIN_SECONDS
    again: list[Any] = []
    in_round = threading.Thread(target=lambda: again.extend(_all_rendezvous(a)), daemon=True)
    in_round.start()
    entered = time.monotonic()
    while rendezvous_node_id(a) in _participants(observer):  # a left the last round
        assert time.monotonic() < deadline, "a never went into the next round"
        time.sleep(0.05)
    if leave_out:
        assert forget_nodes(a, [rendezvous_node_id(b)], coordinator=False, in_round=True,
                            staying=[rendezvous_node_id(a)]) == [rendezvous_node_id(b)]
    in_round.join(JOIN_SECONDS + 10)
    waiting.join(JOIN_SECONDS + 10)
    return [*again, *joined], time.monotonic() - entered


def test_a_member_silent_while_a_node_joins_is_left_out_from_inside_the_round(
        make_handler: Callable[[], Any]) -> None:
    """c10d seeds 862 and 863 of the fault campaign: the round a joining node opened
    waited for a frozen member to leave the last one (until it thawed: up to 15.7 s to
    the next step). Left out by any member's detector while that member waits in the
    round (a holder of its own: torch's is in use by the round), a and c form the next
    world at once; a member that is not the coordinator did nothing before."""
    infos, _ = _join_c_while_b_falls_silent(make_handler, leave_out=True)
    assert all(not isinstance(i, Exception) for i in infos), infos
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}


def test_the_round_after_a_member_left_out_closes_without_its_last_call(
        make_handler: Callable[..., Any]) -> None:
    """Once the next round holds the staying members (a) and the nodes that waited for
    it (c), it closes at once, not after its last call (5 s, as elastic-train run sets
    it): the c10d replay of seed 863 cost 5.5 s to the next step after b was left out."""
    infos, took = _join_c_while_b_falls_silent(make_handler, leave_out=True, last_call=5.0)
    assert all(not isinstance(i, Exception) for i in infos), infos
    assert {i.world_size for i in infos} == {2}
    assert took < 3.5, took  # 5 s of last call, and torch's 1 s polls, before


@pytest.mark.parametrize("make_handler", ["c10d"], indirect=True)  # torch's handler: once
def test_without_it_the_joining_round_waits_for_the_silent_member(
        make_handler: Callable[[], Any]) -> None:
    infos, _ = _join_c_while_b_falls_silent(make_handler, leave_out=False)
    assert all(isinstance(i, RendezvousTimeoutError) for i in infos), infos


def _next_round_after_c_lost_at_its_close(make: Callable[..., Any], stalled: bool
                                          ) -> tuple[list[Any], float]:
    """a, b and c formed a round; c was lost right after it closed (given up by the others'
    round waits, agent/round_ranks.py); a removes it (``stalled``, as the agents do, or
    not); a and b go into the next round. Their results, and the seconds it took."""
    a, b, c = make(5.0), make(5.0), make(5.0)
    assert [i.world_size for i in _all_rendezvous(a, b, c)] == [3, 3, 3]
    c._stop_heartbeats()
    assert forget_nodes(a, [rendezvous_node_id(c)], stalled=stalled) == [rendezvous_node_id(c)]
    began = time.monotonic()
    infos = _all_rendezvous(a, b)
    return infos, time.monotonic() - began


@pytest.mark.parametrize("make_handler", ["c10d"], indirect=True)  # torch's handler
def test_the_round_after_a_member_lost_at_its_close_closes_without_its_last_call(
        make_handler: Callable[..., Any]) -> None:
    """The soak of 6e1ef70 (c10d seed 1100, fault 8): a member cut off right after its
    round closed was given up in 0.5 s, but the next round of the two others waited its
    5 s of last call (8.1 s to the next step). Removed as ``stalled``, the next round
    closes once it holds the round's other members; removed plainly, it waits."""
    infos, took = _next_round_after_c_lost_at_its_close(make_handler, stalled=True)
    assert all(not isinstance(i, Exception) for i in infos), infos
    assert {i.world_size for i in infos} == {2} and took < 3.5, took


@pytest.mark.parametrize("make_handler", ["c10d"], indirect=True)
def test_removed_plainly_the_round_after_it_waits_its_last_call(
        make_handler: Callable[..., Any]) -> None:
    """(5 s of last call and torch's 1 s polls: past this test's 6 s join timeout.)"""
    _, took = _next_round_after_c_lost_at_its_close(make_handler, stalled=False)
    assert took >= 4.5, took


def test_unknown_nodes_and_handlers_without_a_state_are_left_alone(
        make_handler: Callable[[], Any]) -> None:
    a, b = make_handler(), make_handler()
    _all_rendezvous(a, b)
    assert forget_nodes(a, ["127.0.0.1_1_999", ""]) == []
    assert _participants(a) == {rendezvous_node_id(a), rendezvous_node_id(b)}
    plain = SimpleNamespace()  # a handler with no state of torch's: nothing to forget
    assert forget_nodes(plain, ["x"]) == [] and rendezvous_node_id(plain) == ""  # type: ignore[arg-type]


def test_leave_open_stops_a_dynamic_handler_s_heartbeats_without_closing_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent that ends with an error leaves the rendezvous open (rendezvous/forget.py's
    ``leave_open``): torch's shutdown would close it for every node. Its heartbeats stop
    all the same: left running, one logged its failure to a store that was gone after the
    agent's last line (test_c10d_the_stores_host_killed_ends_the_other_node_with_one_line,
    once in a clean-clone run)."""
    from elastic_train.rendezvous.forget import leave_open

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))

    def make() -> DynamicRendezvousHandler:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=30))
        return DynamicRendezvousHandler.from_backend(
            RUN_ID, client, C10dRendezvousBackend(client, RUN_ID), min_nodes=1, max_nodes=2,
            local_addr="127.0.0.1", timeout=RendezvousTimeout(
                join=timedelta(seconds=JOIN_SECONDS), last_call=timedelta(seconds=0.3)),
            keep_alive_interval=0.1, keep_alive_max_attempt=100)

    leaving, staying = make(), make()
    threads = [threading.Thread(target=h.next_rendezvous) for h in (leaving, staying)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    def beat_of(node: Any) -> Any:
        staying._state_holder.sync()
        return staying._state_holder.state.last_heartbeats[node]

    node = leaving._this_node
    leave_open(leaving)
    assert leaving.shutdown() is True
    stopped_at = beat_of(node)
    time.sleep(0.5)  # five heartbeat intervals: a running heartbeat would have moved it
    assert beat_of(node) == stopped_at
    assert not staying.is_closed()
    staying._stop_heartbeats()
