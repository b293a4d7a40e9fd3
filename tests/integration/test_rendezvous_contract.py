"""One contract, two implementations: the etcd-v3 backend and store on a fake and on etcd.

Every test here runs against ``MemoryKV`` (the in-memory fake) and against a real etcd
3.4 started without the v2 API; the store tests also run against torch's own HashStore,
whose behaviour is the reference. A fake that passes and an etcd that fails (or the
other way round) means the fake lies.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.utils.store import barrier

from elastic_train.rendezvous.etcd_v3.client import EtcdKV
from elastic_train.rendezvous.etcd_v3.kv import KV
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options, parse_endpoint
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease
from elastic_train.rendezvous.etcd_v3.state_backend import EtcdV3RendezvousBackend
from elastic_train.rendezvous.etcd_v3.state_key import build_handler
from elastic_train.rendezvous.etcd_v3.store import EtcdStore
from tests.integration.threads import run_threads
from tests.memory_kv import MemoryKV

PREFIX = "/contract"


@pytest.fixture(params=["memory", "etcd"])
def kv(request: pytest.FixtureRequest) -> KV:
    if request.param == "memory":
        return MemoryKV()
    server = request.getfixturevalue("etcd_v3")
    return EtcdKV(parse_endpoint(server.endpoint, None), request_timeout=5)


def new_backend(kv: KV, ttl: int = 3600, run_id: str | None = None) -> EtcdV3RendezvousBackend:
    return EtcdV3RendezvousBackend(kv, run_id or uuid.uuid4().hex, PREFIX, SharedLease(kv, ttl))


# ---- backend ------------------------------------------------------------------------------


def test_backend_is_named_etcd_v3(kv: KV) -> None:
    assert new_backend(kv).name == "etcd-v3"


def test_a_new_rendezvous_has_no_state(kv: KV) -> None:
    assert new_backend(kv).get_state() is None


def test_create_if_absent(kv: KV) -> None:
    backend = new_backend(kv)
    state, token, won = backend.set_state(b"first")
    assert (state, won) == (b"first", True)
    # Without a token a write only creates: the existing state comes back, unchanged.
    assert backend.set_state(b"second") == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_the_current_token_wins_and_is_replaced(kv: KV) -> None:
    backend = new_backend(kv)
    _, token, _ = backend.set_state(b"v1")
    state, new_token, won = backend.set_state(b"v2", token)
    assert (state, won) == (b"v2", True)
    assert new_token != token
    assert backend.get_state() == (b"v2", new_token)


def test_a_stale_token_loses_and_gets_the_winners_state(kv: KV) -> None:
    run_id = uuid.uuid4().hex
    node_a, node_b = new_backend(kv, run_id=run_id), new_backend(kv, run_id=run_id)
    _, token, _ = node_a.set_state(b"round-0")
    assert node_b.get_state() == (b"round-0", token)
    _, a_token, a_won = node_a.set_state(b"a-joined", token)
    state, b_token, b_won = node_b.set_state(b"b-joined", token)  # same, now stale, token
    assert (a_won, b_won) == (True, False)
    assert (state, b_token) == (b"a-joined", a_token)
    assert node_b.set_state(b"b-joined", b_token)[2] is True  # retry with the fresh token


@pytest.mark.parametrize("token", ["abc", b"7", 1.5, True, -3, 0.0])
def test_a_token_we_did_not_hand_out_never_matches(kv: KV, token: Any) -> None:
    backend = new_backend(kv)
    assert backend.set_state(b"x", token) is None  # nothing there: nothing to return
    _, real, _ = backend.set_state(b"x")
    assert backend.set_state(b"y", token) == (b"x", real, False)


def test_the_token_of_a_vanished_state_gives_none(kv: KV) -> None:
    backend = new_backend(kv)
    _, token, _ = backend.set_state(b"x")
    assert kv.delete(backend.key)
    assert backend.set_state(b"y", token) is None
    assert backend.get_state() is None


def test_concurrent_writers_lose_no_update(kv: KV) -> None:
    """Each writer appends to a shared list with read / compare-and-swap retries."""
    run_id, writers, rounds = uuid.uuid4().hex, 6, 6

    def writer(i: int) -> int:
        backend, attempts = new_backend(kv, run_id=run_id), 0
        for r in range(rounds):
            current = backend.get_state()
            while True:
                attempts += 1
                items = json.loads(current[0]) if current else []
                result = backend.set_state(json.dumps([*items, f"{i}.{r}"]).encode(),
                                           current[1] if current else None)
                assert result is not None
                if result[2]:
                    break
                current = result[:2]
        return attempts

    attempts = run_threads(writer, writers)
    final = json.loads(new_backend(kv, run_id=run_id).get_state()[0])
    assert sorted(final) == sorted(f"{i}.{r}" for i in range(writers) for r in range(rounds))
    assert sum(attempts) >= writers * rounds


def test_corrupt_state_is_an_error_naming_the_key(kv: KV) -> None:
    backend = new_backend(kv)
    kv.put(backend.key, b"\x80\x04garbage, not a rendezvous state")
    with pytest.raises(RendezvousStateError, match=backend.key) as info:
        backend.get_state()
    assert "use a new --rdzv-id" in str(info.value)
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"new")  # the create loses and returns the corrupt value
    truncated = new_backend(kv)
    kv.put(truncated.key, b"elastic-train/rendezvous")
    with pytest.raises(RendezvousStateError):
        truncated.get_state()


def test_runs_do_not_see_each_other(kv: KV) -> None:
    one, two = new_backend(kv), new_backend(kv)
    one.set_state(b"one")
    assert two.get_state() is None


def test_the_state_expires_with_its_lease(kv: KV) -> None:
    backend = new_backend(kv, ttl=2)  # etcd's shortest lease is about 2 s
    backend.set_state(b"abandoned")
    if isinstance(kv, MemoryKV):
        kv.advance(2.5)
        assert backend.get_state() is None
        return
    deadline = time.monotonic() + 15
    while backend.get_state() is not None:
        assert time.monotonic() < deadline, "the state outlived its lease"
        time.sleep(0.2)


# ---- store --------------------------------------------------------------------------------


@pytest.fixture(params=["hashstore", "memory", "etcd"])
def store(request: pytest.FixtureRequest) -> Iterator[dist.Store]:
    timeout = timedelta(seconds=5)
    if request.param == "hashstore":
        reference = dist.HashStore()
        reference.set_timeout(timeout)
        yield reference
        return
    if request.param == "memory":
        backing: KV = MemoryKV()
    else:
        server = request.getfixturevalue("etcd_v3")
        backing = EtcdKV(parse_endpoint(server.endpoint, None), request_timeout=5)
    yield EtcdStore(backing, f"{PREFIX}/{uuid.uuid4().hex}/store/", SharedLease(backing, 600),
                    timeout)


def test_set_and_get(store: dist.Store) -> None:
    store.set("text", "value")
    store.set("bytes", b"\x00\xff")
    assert store.get("text") == b"value"
    assert store.get("bytes") == b"\x00\xff"
    store.set("text", "")
    assert store.get("text") == b""


def test_get_waits_for_a_key_written_later(store: dist.Store) -> None:
    timer = threading.Timer(0.3, lambda: store.set("late", "here"))
    timer.start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - started >= 0.25
    timer.join()


def test_waits_time_out(store: dist.Store) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.2))


def test_add_is_atomic_across_threads(store: dist.Store) -> None:
    assert store.add("counter", 5) == 5
    assert store.add("counter", -2) == 3
    results = run_threads(lambda i: [store.add("counter", 1) for _ in range(5)], 4)
    assert store.get("counter") == b"23"
    assert sorted(v for r in results for v in r) == list(range(4, 24))


def test_compare_set_follows_c10d(store: dist.Store) -> None:
    assert store.compare_set("k", "", "first") == b"first"     # absent, expected empty: set
    assert store.compare_set("k", "other", "x") == b"first"    # mismatch: current comes back
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    assert store.compare_set("absent", "expected", "x") == b"expected"  # absent: not set
    assert not store.check(["absent"])


def test_multi_set_multi_get_check_wait(store: dist.Store) -> None:
    store.multi_set(["a", "b", "c"], ["1", b"2", "3"])
    assert store.multi_get(["c", "a"]) == [b"3", b"1"]
    assert store.check(["a", "b"])
    assert not store.check(["a", "zzz"])
    store.wait(["a", "b", "c"])
    store.wait(["a"], timedelta(seconds=1))


def test_delete_key_and_num_keys(store: dist.Store) -> None:
    before = store.num_keys()
    store.set("gone", "1")
    store.set("kept", "1")
    assert store.num_keys() == before + 2
    assert store.delete_key("gone") is True
    assert store.delete_key("gone") is False
    assert store.num_keys() == before + 1


def test_the_agents_prefix_store_and_barrier_work(store: dist.Store) -> None:
    """What torch's agent does with the store: a per-round PrefixStore and its barrier."""
    round_store = dist.PrefixStore("torch.rendezvous.job.3", store)
    round_store.multi_set(["torchelastic/assigned_ranks/0", "torchelastic/assigned_ranks/1"],
                          ["[0, 4]", "[2, 4]"])
    assert round_store.get("torchelastic/assigned_ranks/1") == b"[2, 4]"
    assert round_store.multi_get(["torchelastic/assigned_ranks/0"]) == [b"[0, 4]"]
    run_threads(lambda i: barrier(round_store, 3, "exit/", barrier_timeout=20), 3)
    assert round_store.get("exit//num_members") == b"3"


# ---- the whole handler: torch's DynamicRendezvousHandler on our backend and store ---------


def test_handlers_in_threads_form_one_world(kv: KV, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    options = EtcdV3Options.parse("127.0.0.1:2379", {"key_prefix": PREFIX})
    run_id, nodes = uuid.uuid4().hex, 3

    def node(i: int) -> tuple[int, int, str]:
        handler = build_handler(kv, options, run_id, nodes, nodes, local_addr=f"node{i}")
        info = handler.next_rendezvous()
        return info.rank, info.world_size, info.bootstrap_store_info.master_addr

    results = run_threads(node, nodes)
    assert sorted(r[0] for r in results) == [0, 1, 2]
    assert {r[1] for r in results} == {nodes}
    assert {r[2] for r in results} == {"node0"}  # rank 0 published its address to all
