"""The memory tier of checkpoints: the contract's pure parts (live/memory_tier.py), real
snapshot holders on loopback (agent/snapshot_holder.py, in-process threads), the worker's
client (worker/memory_tier.py) and the agents' directory in a round's store
(agent/holder_directory.py)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from elastic_train.agent import snapshot_holder
from elastic_train.agent.holder_directory import HolderDirectory
from elastic_train.agent.snapshot_holder import SnapshotHolder, holder_address, parse_size
from elastic_train.errors import MemoryTierError
from elastic_train.live.environment import MEMORY_TIER, WORKER_ENV_FILE
from elastic_train.live.memory_tier import (
    HOLDER_KEY,
    MANIFEST_HEADER,
    SNAPSHOT_PATH,
    Endpoint,
    HolderEntry,
    call,
    check_manifest,
    encode_manifest,
    is_newer,
    newest_of,
    replica_order,
)
from elastic_train.worker.memory_tier import MemoryTierClient
from tests.memory_store import MemoryStore
from tests.polling import wait_until

RUN = "job-1"


def snapshot(step: int, epoch: int = 1, size: int = 4096) -> tuple[dict[str, object], bytes]:
    payload = (f"{epoch}:{step}:".encode() * size)[:size]
    return {"run_id": RUN, "writer_epoch": epoch, "step": step,
            "sha256": hashlib.sha256(payload).hexdigest(), "bytes": size}, payload


@pytest.fixture
def holders() -> Iterator[list[SnapshotHolder]]:
    """Two holders of run RUN on loopback, each the other's peer (as on two hosts)."""
    a = SnapshotHolder("127.0.0.1", run_id=RUN).start()
    b = SnapshotHolder("127.0.0.1", run_id=RUN).start()
    entries = [HolderEntry(a.url, a.token, "host-a", 0), HolderEntry(b.url, b.token, "host-b", 1)]
    a.host, b.host = "host-a", "host-b"
    a.set_peers(entries)
    b.set_peers(entries)
    yield [a, b]
    a.close()
    b.close()


def client(holder: SnapshotHolder) -> MemoryTierClient:
    return MemoryTierClient(holder.endpoint, RUN)


# ---- the contract's pure parts -------------------------------------------------------------
def test_the_newest_is_by_writer_epoch_then_step() -> None:
    old, new_epoch = snapshot(50, epoch=1)[0], snapshot(3, epoch=2)[0]
    assert is_newer(new_epoch, old) and not is_newer(old, new_epoch)
    assert is_newer(old, None) and is_newer(old, old)  # the same step saved again replaces
    assert newest_of([None, old, new_epoch, snapshot(49)[0]]) == new_epoch
    assert newest_of([None]) is None


@pytest.mark.parametrize(("change", "said"), [
    ({"step": -1}, "step"), ({"bytes": "9"}, "bytes"), ({"sha256": "AB"}, "sha256"),
    ({"run_id": ""}, "run_id"), ({"writer_epoch": True}, "writer_epoch"),
    ({"note": "x" * 20000}, "over"),
])
def test_a_bad_manifest_is_refused_saying_what(change: dict[str, object], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        check_manifest({**snapshot(1)[0], **change})
    with pytest.raises(ValueError, match="lacks sha256"):
        check_manifest({k: v for k, v in snapshot(1)[0].items() if k != "sha256"})


def test_the_copy_goes_to_the_next_agent_on_another_host_first() -> None:
    entries = [HolderEntry(f"http://h{r}", "t", host, r)
               for r, host in enumerate(["x", "x", "y", "x", "z"])]
    order = [e.rank for e in replica_order("http://h1", "x", entries)]
    assert order == [2, 4, 3, 0]  # the ring from rank 2: other hosts first, then this one
    assert [e.rank for e in replica_order("http://h4", "z", entries)] == [0, 1, 2, 3]
    assert replica_order("http://h0", "x", entries[:1]) == []  # alone: no copy


def test_sizes_and_endpoints_read_back() -> None:
    assert parse_size("16G") == 16 * 1024 ** 3 and parse_size("1500") == 1500
    assert parse_size("2MiB") == 2 * 1024 ** 2
    for bad in ("0", "-1G", "lots"):
        with pytest.raises(ValueError, match="give a size"):
            parse_size(bad)
    endpoint = Endpoint("http://127.0.0.1:1", "tok", 10)
    assert Endpoint.from_json(endpoint.to_json()) == endpoint
    with pytest.raises(ValueError):
        Endpoint.from_json('{"url": "ftp://x", "token": "t"}')
    assert holder_address(True, None, None) == ("127.0.0.1", "127.0.0.1")
    assert holder_address(False, "127.0.0.1", "127.0.0.1")[0] == "127.0.0.1"


def test_the_client_is_none_without_an_agent_and_reads_the_agents_file(tmp_path) -> None:
    assert MemoryTierClient.from_env({"TORCHELASTIC_RUN_ID": RUN}) is None
    endpoint = Endpoint("http://127.0.0.1:9", "tok", 5)
    found = MemoryTierClient.from_env({MEMORY_TIER: endpoint.to_json(),
                                       "TORCHELASTIC_RUN_ID": RUN})
    assert found is not None and found.endpoint == endpoint and found.run_id == RUN
    late = tmp_path / "env.json"  # a forked worker learns it from the agent's file
    late.write_text(json.dumps({MEMORY_TIER: endpoint.to_json()}))
    found = MemoryTierClient.from_env({WORKER_ENV_FILE: str(late), "TORCHELASTIC_RUN_ID": RUN})
    assert found is not None and found.endpoint == endpoint
    with pytest.raises(MemoryTierError, match="holds no holder"):
        MemoryTierClient.from_env({MEMORY_TIER: "{}"})


# ---- real holders ------------------------------------------------------------------------
def test_an_offer_is_held_on_two_nodes_and_answers_two_copies(holders) -> None:
    a, b = holders
    manifest, payload = snapshot(5)
    worker = client(a)
    assert worker.offer(manifest, payload) == 2
    assert worker.held_by == [a.url, b.url]
    assert a.held(RUN) == manifest and b.held(RUN) == manifest
    assert worker.newest() == manifest and worker.fetch(manifest) == payload


def test_a_newer_snapshot_replaces_the_held_one_and_an_older_is_refused(holders) -> None:
    a, b = holders
    worker = client(a)
    first, second = snapshot(5), snapshot(10)
    worker.offer(*first)
    worker.offer(*second)
    assert a.held(RUN) == second[0] and b.held(RUN) == second[0]
    with pytest.raises(MemoryTierError, match="no step 5"):
        worker.fetch(first[0])  # one snapshot per run: the older one is gone
    with pytest.raises(MemoryTierError, match="newer snapshot is held"):
        worker.offer(*snapshot(7))  # a stale world's snapshot does not overwrite
    assert worker.offer(*snapshot(1, epoch=2)) == 2  # a newer writer epoch does
    with pytest.raises(MemoryTierError, match="keeps run"):
        other, payload = snapshot(1, epoch=3)
        del other["run_id"]  # the client's own run fills it in
        MemoryTierClient(a.endpoint, "other-run").offer(other, payload)


def test_newest_and_fetch_come_through_the_own_agent_from_a_peer(holders) -> None:
    """The bytes are held only by the other holder (say, on the node whose workers
    saved): a worker of this node asks its own agent, which asks and relays."""
    a, b = holders
    manifest, payload = snapshot(8, size=3 * 1024 * 1024 + 17)  # over one relayed chunk
    b.set_peers([])  # b keeps its one copy
    assert client(b).offer(manifest, payload) == 1
    assert a.held(RUN) is None
    here = client(a)
    assert here.newest() == manifest
    assert here.fetch(manifest) == payload
    assert a.held(RUN) is None  # relayed, not kept


def test_a_wrong_token_is_refused_and_nothing_is_kept(holders) -> None:
    a, _ = holders
    manifest, payload = snapshot(5)
    answer = call(Endpoint(a.url, "not-the-token"), "PUT", SNAPSHOT_PATH, payload,
                  {MANIFEST_HEADER: encode_manifest(manifest)})
    assert answer.status == 401
    assert call(Endpoint(a.url, ""), "GET", f"/v1/newest?run_id={RUN}").status == 401
    with pytest.raises(MemoryTierError, match="401"):
        MemoryTierClient(Endpoint(a.url, "wrong"), RUN).offer(manifest, payload)
    assert a.held(RUN) is None


def test_a_corrupt_payload_is_refused(holders) -> None:
    a, b = holders
    manifest, payload = snapshot(5)
    bad = bytearray(payload)
    bad[100] ^= 1
    with pytest.raises(MemoryTierError, match="sha256"):
        client(a).offer(manifest, bad)
    short = call(a.endpoint, "PUT", SNAPSHOT_PATH, payload[:-1],
                 {MANIFEST_HEADER: encode_manifest(manifest)})
    assert short.status == 400 and b"Content-Length" in short.body
    assert a.held(RUN) is None and b.held(RUN) is None


def test_fetch_checks_the_bytes_against_the_manifest(holders) -> None:
    a, _ = holders
    manifest, payload = snapshot(5)
    client(a).offer(manifest, payload)
    with pytest.raises(MemoryTierError, match="has no step"):
        client(a).fetch({**manifest, "sha256": "0" * 64})


def test_a_killed_peer_leaves_one_copy_answered_at_once(holders) -> None:
    a, b = holders
    b.close()
    worker = client(a)
    started = time.monotonic()
    assert worker.offer(*snapshot(5)) == 1
    assert worker.newest() == snapshot(5)[0]
    assert time.monotonic() - started < 2.0
    assert worker.held_by == [a.url]


def test_a_frozen_peer_costs_a_bounded_wait(holders) -> None:
    """A peer whose host accepts connections but never answers (a frozen agent): a copy
    waits what a peer needs to check its bytes (about 3 s for a small one), not the 10 s
    of any read, and the peer is skipped for the next saves (a training loop whose save
    waits on the copy lost 9.8 s to it, then again 5 s later: CI, stop 45)."""
    a, _ = holders
    with socket.create_server(("127.0.0.1", 0), backlog=8) as frozen:
        url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        a.set_peers([HolderEntry(url, "t", "host-c", 1)])
        started = time.monotonic()
        assert client(a).offer(*snapshot(5, size=1024)) == 1
        first = time.monotonic() - started
        assert client(a).newest() == snapshot(5, size=1024)[0]  # skipped: it failed just now
        assert client(a).offer(*snapshot(6, size=1024)) == 1
        assert first < 4.0 and time.monotonic() - started - first < 0.5
    assert snapshot_holder.PEER_SILENT_SECONDS > snapshot_holder.PEER_DOWN_SECONDS
    assert snapshot_holder.replica_answer_seconds(10 * 10**9) > 50  # a big one is checked


def test_a_payload_over_the_limit_is_refused() -> None:
    with SnapshotHolder("127.0.0.1", run_id=RUN, max_bytes=1000) as holder:
        manifest, payload = snapshot(5, size=2000)
        with pytest.raises(MemoryTierError, match="over the holders' limit"):
            client(holder).offer(manifest, payload)  # the client knows the limit
        unaware = MemoryTierClient(Endpoint(holder.url, holder.token), RUN)
        with pytest.raises(MemoryTierError, match=r"413|did not answer"):
            unaware.offer(manifest, payload)
        assert holder.held(RUN) is None
        assert unaware.offer(*snapshot(6, size=1000)) == 1


def test_the_agents_find_each_others_holders_in_the_rounds_store(holders) -> None:
    a, b = holders
    store = MemoryStore()
    first, second = HolderDirectory(a, look_every=0.01), HolderDirectory(b, look_every=0.01)
    first.publish(store, 0, 3)  # rank 2 never shows (an agent that died at once)
    assert a.peers == []                                       # its own copy only, until found
    second.publish(store, 1, 3)
    wait_until(lambda: [p.url for p in b.peers] == [a.url], 10, "b finding a")
    wait_until(lambda: [p.url for p in a.peers] == [b.url], 10, "a finding b")
    assert json.loads(store.get(HOLDER_KEY.format(rank=1)))["url"] == b.url
    assert not first.settled()                                 # rank 2 is still looked for
    assert client(a).offer(*snapshot(5)) == 2


def test_a_store_that_does_not_answer_never_holds_the_agents_loop(holders) -> None:
    """On etcd-v3 the round's store is etcd: down, each request waits its retry (10 s).
    Publishing returns at once; the lookups wait in the directory's thread."""
    a, _ = holders
    answer = threading.Event()

    class Down(MemoryStore):
        def set(self, key: str, value: str | bytes) -> None:
            answer.wait(10)
            super().set(key, value)

    store = Down()
    directory = HolderDirectory(a, look_every=0.01)
    began = time.monotonic()
    directory.publish(store, 0, 2)
    assert time.monotonic() - began < 0.5 and not directory.settled()
    answer.set()                                              # etcd is back
    MemoryStore.set(store, HOLDER_KEY.format(rank=1), HolderEntry("http://b", "t", "b", 1)
                    .to_json())
    wait_until(directory.settled, 10, "the directory settling once the store answers")
    assert [p.url for p in a.peers] == ["http://b"]


def test_a_store_that_cannot_list_leaves_one_copy(holders, caplog) -> None:
    a, _ = holders

    class Broken(MemoryStore):
        def set(self, key: str, value: str | bytes) -> None:
            raise RuntimeError("no such store")

    a.set_peers([])
    directory = HolderDirectory(a)
    directory.publish(Broken(), 0, 2)
    wait_until(directory.settled, 10, "the directory giving up")
    assert "keeps its one copy" in caplog.text
    assert client(a).offer(*snapshot(5)) == 1


def test_the_launcher_takes_the_memory_tier_options() -> None:
    from elastic_train.agent.launch import launcher_parser

    ns = launcher_parser().parse_args([])
    assert ns.memory_tier == "on" and ns.memory_tier_limit == 16 * 1024 ** 3
    ns = launcher_parser().parse_args(["--memory-tier", "off", "--memory-tier-limit", "2G"])
    assert ns.memory_tier == "off" and ns.memory_tier_limit == 2 * 1024 ** 3
    with pytest.raises(SystemExit):
        launcher_parser().parse_args(["--memory-tier-limit", "lots"])


# ---- a sharded checkpoint's parts ------------------------------------------------------------
def part(step: int, rank: int, parts: int, epoch: int = 1) -> tuple[dict[str, object], bytes]:
    manifest, payload = snapshot(step, epoch, size=1024 + rank)
    return {**manifest, "part": rank, "parts": parts, "generation": 0}, payload


def test_each_rank_offers_its_part_and_the_holders_keep_the_newest_two_of_each(holders) -> None:
    """Parts are held per rank beside the unsharded snapshot; each part keeps the save
    before its newest (a rank killed while the others offer the next save leaves the
    newest incomplete), and a reader through either agent sees every copy."""
    a, b = holders
    worker_a, worker_b = client(a), client(b)
    for step in (5, 10, 15):
        assert worker_a.offer(*part(step, 0, 2)) == 2
        if step != 15:  # rank 1 dies before it offers its part of 15
            assert worker_b.offer(*part(step, 1, 2)) == 2
    assert [m["step"] for m in worker_a.kept(0)] == [15, 10]
    assert [m["step"] for m in worker_b.kept(1)] == [10, 5]
    assert worker_a.newest() is None  # no unsharded snapshot: parts are their own
    wanted, payload = part(10, 1, 2)
    assert worker_a.fetch(wanted) == payload
    with pytest.raises(MemoryTierError, match="newer snapshot is held"):
        worker_b.offer(*part(7, 1, 2))


def test_parts_beyond_a_shrunken_world_are_let_go(holders) -> None:
    a, _ = holders
    worker = client(a)
    for rank in range(3):
        worker.offer(*part(5, rank, 3))
    worker.offer(*part(10, 0, 2, epoch=2))
    assert a.kept(RUN, 2) == [] and [m["step"] for m in a.kept(RUN, 1)] == [5]


@pytest.mark.parametrize(("change", "said"), [
    ({"part": 2, "parts": 2}, "part below parts"),
    ({"part": 0}, "part and parts go together"),
    ({"part": -1, "parts": 2}, "part is not a non-negative integer"),
])
def test_a_bad_part_is_refused_saying_what(change: dict[str, object], said: str) -> None:
    manifest, _ = snapshot(5)
    with pytest.raises(ValueError, match=said):
        check_manifest({**manifest, **change})
