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
    options = EtcdV3Options.parse("127.0.0.1:2379", {
        "design": "state-key", "join_timeout": JOIN_SECONDS, "last_call_timeout": 0.3,
        "keep_alive_interval": 60, "keep_alive_max_attempt": 10})
    made: list[DynamicRendezvousHandler] = []

    def make() -> DynamicRendezvousHandler:
        if request.param != "c10d":
            handler = build_handler(kv, options, RUN_ID, 2, 3, local_addr="127.0.0.1")
            made.append(handler)
            return handler
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=30))
        handler = DynamicRendezvousHandler.from_backend(
            RUN_ID, client, C10dRendezvousBackend(client, RUN_ID), min_nodes=2, max_nodes=3,
            local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=timedelta(seconds=JOIN_SECONDS),
                                      last_call=timedelta(seconds=0.3)),
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
    joined: list[Any] = []
    waiting = threading.Thread(target=lambda: joined.extend(_all_rendezvous(c)), daemon=True)
    waiting.start()
    deadline = time.monotonic() + JOIN_SECONDS
    while a.num_nodes_waiting() == 0:  # what a's agent watches for
        assert time.monotonic() < deadline, "the new node never showed up as waiting"
        time.sleep(0.05)
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
