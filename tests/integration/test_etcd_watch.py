"""The KV operations of the watch-based rendezvous: prefix reads, create-if-absent
transactions, per-node leases kept alive, and watches, on the fake and on a real etcd.

Like the contract tests, each test runs against ``MemoryKV`` and against a real etcd 3.4
(v3 API only): the fake must behave as etcd does. Tests that stop an etcd start their own.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_train.rendezvous.etcd_v3.client import Credentials, Endpoint, EtcdKV
from elastic_train.rendezvous.etcd_v3.gateway import MAX_TXN_OPS
from elastic_train.rendezvous.etcd_v3.kv import (
    KV,
    EtcdUnreachableError,
    Watch,
    WatchCompacted,
    WatchEvent,
)
from tests import tools
from tests.etcd_server import EtcdServer, TlsFiles
from tests.memory_kv import MemoryKV


def etcd_kv(server: EtcdServer, request_timeout: float = 5) -> EtcdKV:
    return EtcdKV(Endpoint("127.0.0.1", server.port), request_timeout=request_timeout)


@pytest.fixture(params=["memory", "etcd"])
def kv(request: pytest.FixtureRequest) -> KV:
    if request.param == "memory":
        return MemoryKV()
    return etcd_kv(request.getfixturevalue("etcd_v3"))


@pytest.fixture
def prefix() -> str:
    return f"/watch-test/{uuid.uuid4().hex}/"


@pytest.fixture
def watches() -> Iterator[Callable[[KV, str, int], Watch]]:
    """``open(kv, prefix, start_revision)``: a watch cancelled (its reader joined) after."""
    opened: list[Watch] = []

    def open_watch(kv: KV, prefix: str, start_revision: int) -> Watch:
        opened.append(kv.watch_prefix(prefix, start_revision))
        return opened[-1]

    yield open_watch
    for watch in opened:
        watch.cancel()
    for watch in opened:
        assert_reader_ends(watch)


def assert_reader_ends(watch: Watch, timeout: float = 2.0) -> None:
    thread = getattr(watch, "_thread", None)  # EtcdKV's stream reader; none on the fake
    if thread is not None:
        thread.join(timeout)
        assert not thread.is_alive(), "the watch's reader thread outlived the watch"


def collect(watch: Watch, count: int, timeout: float = 10.0) -> list[WatchEvent]:
    """Exactly ``count`` events from ``watch`` (fails after ``timeout`` s, or on more)."""
    events: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while len(events) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{len(events)} of {count} events in {timeout} s: {events}"
        events += watch.next(min(remaining, 1.0))
    assert len(events) == count, events
    assert watch.next(0.2) == [], "more events than the writes made"
    return events


def compact(kv: KV, revision: int) -> None:
    """Compact the store's history before ``revision`` (a test hook on the fake)."""
    if isinstance(kv, MemoryKV):
        kv.compact(revision)
        return
    assert isinstance(kv, EtcdKV)
    client = kv._connect()
    client.post(client.get_url("/kv/compaction"), json={"revision": str(revision)})


def delete_event(key: str, revision: int) -> WatchEvent:
    return WatchEvent("delete", key, b"", revision, 0)


# ---- reads and transactions ----------------------------------------------------------------


def test_range_prefix_is_sorted_with_both_revisions_and_a_watch_point(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    kv.put(prefix + "b", b"2")
    kv.put(prefix + "a", b"1")
    kv.put(prefix + "a", b"1.1")
    kv.put(prefix + "c/deeper", b"3")
    kv.put(prefix.rstrip("/") + "-sibling", b"not under the prefix")
    kvs, revision = kv.range_prefix(prefix)
    assert [(k.key, k.value) for k in kvs] == [
        (prefix + "a", b"1.1"), (prefix + "b", b"2"), (prefix + "c/deeper", b"3")]
    a, b, c = kvs
    assert b.mod_revision < a.create_revision < a.mod_revision < c.mod_revision
    assert b.create_revision == b.mod_revision
    assert revision >= c.mod_revision
    assert kv.range_prefix(prefix + "nothing/") == ([], revision)

    watch = watches(kv, prefix, revision + 1)
    kv.put(prefix + "d", b"4")
    kv.put(prefix.rstrip("/") + "-sibling", b"still not under it")
    assert kv.delete(prefix + "b")
    put, deleted = collect(watch, 2)
    assert (put.kind, put.key, put.value) == ("put", prefix + "d", b"4")
    assert put.mod_revision == put.create_revision > revision
    assert deleted == delete_event(prefix + "b", deleted.mod_revision)
    assert deleted.mod_revision > put.mod_revision + 1  # the sibling's write in between


def test_put_many_if_absent_puts_all_or_nothing(kv: KV, prefix: str) -> None:
    guard = prefix + "round/1/closed"
    items = [(guard, b""), (prefix + "round/1/x", b"1"), (prefix + "round/1/y", b"2")]
    assert kv.put_many_if_absent(guard, items)
    kvs, _ = kv.range_prefix(prefix)
    assert [(k.key, k.value) for k in kvs] == sorted(items)
    assert len({k.mod_revision for k in kvs}) == 1  # one transaction, one revision
    assert not kv.put_many_if_absent(guard, [(guard, b"again"), (prefix + "round/1/z", b"3")])
    assert kv.range_prefix(prefix)[0] == kvs
    with pytest.raises(ValueError, match="one transaction"):
        kv.put_many_if_absent(prefix + "g", [(f"{prefix}k{i}", b"") for i in
                                             range(MAX_TXN_OPS + 1)])
    # On a lease, every key goes with it.
    lease = kv.grant_lease(60)
    assert kv.put_many_if_absent(prefix + "leased/g", [(prefix + "leased/g", b""),
                                                       (prefix + "leased/k", b"")], lease)
    kv.revoke_lease(lease)
    assert kv.range_prefix(prefix + "leased/")[0] == []


# ---- watches -------------------------------------------------------------------------------


def test_a_watch_sees_puts_and_deletes_in_order(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    _, revision = kv.range_prefix(prefix)
    watch = watches(kv, prefix, revision + 1)
    assert watch.next(0.1) == []
    kv.put(prefix + "a", b"1")
    kv.put(prefix + "a", b"2")
    kv.put_many([(prefix + "b", b"b"), (prefix + "c", b"c")])
    kv.delete(prefix + "a")
    events = collect(watch, 5)
    assert [(e.kind, e.key, e.value) for e in events] == [
        ("put", prefix + "a", b"1"), ("put", prefix + "a", b"2"), ("put", prefix + "b", b"b"),
        ("put", prefix + "c", b"c"), ("delete", prefix + "a", b"")]
    first, second, b, c, deleted = events
    assert first.mod_revision == first.create_revision == revision + 1
    assert (second.mod_revision, second.create_revision) == (revision + 2, revision + 1)
    assert b.mod_revision == c.mod_revision == revision + 3  # one transaction
    assert b.create_revision == c.create_revision == revision + 3
    assert deleted == delete_event(prefix + "a", revision + 4)


def test_a_watch_from_an_older_revision_replays_what_came_since(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    kv.put(prefix + "before", b"0")
    _, revision = kv.range_prefix(prefix)
    kv.put(prefix + "x", b"1")
    kv.delete(prefix + "before")
    kv.put(prefix + "y", b"2")
    watch = watches(kv, prefix, revision + 1)
    replayed = collect(watch, 3)
    assert [(e.kind, e.key) for e in replayed] == [
        ("put", prefix + "x"), ("delete", prefix + "before"), ("put", prefix + "y")]
    assert [e.mod_revision for e in replayed] == [revision + 1, revision + 2, revision + 3]
    kv.put(prefix + "z", b"3")  # and then the live changes
    assert [e.key for e in collect(watch, 1)] == [prefix + "z"]
    # From the revision of the first change on, inclusive.
    assert collect(watches(kv, prefix, revision + 2), 3)[0].key == prefix + "before"


def test_a_compacted_start_revision_raises_watch_compacted(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    kv.put(prefix + "a", b"1")
    _, old = kv.range_prefix(prefix)
    kv.put(prefix + "a", b"2")
    kv.put(prefix + "b", b"3")
    _, now = kv.range_prefix(prefix)
    compact(kv, now)
    watch = watches(kv, prefix, old + 1)
    with pytest.raises(WatchCompacted) as info:
        collect(watch, 1, timeout=5)
    assert info.value.compact_revision == now
    with pytest.raises(WatchCompacted):  # the watch is dead
        watch.next(0.1)
    # From the compaction's revision on, the history is still there.
    assert [e.key for e in collect(watches(kv, prefix, now), 1)] == [prefix + "b"]


def test_cancel_wakes_a_blocked_next(kv: KV, prefix: str) -> None:
    watch = kv.watch_prefix(prefix, kv.range_prefix(prefix)[1] + 1)
    cancelled_at: list[float] = []

    def cancel() -> None:
        cancelled_at.append(time.monotonic())
        watch.cancel()

    timer = threading.Timer(0.3, cancel)
    timer.start()
    assert watch.next(10) == []
    returned = time.monotonic()
    timer.join(5)
    assert cancelled_at and returned - cancelled_at[0] < 1.0
    assert_reader_ends(watch)
    watch.cancel()  # idempotent
    kv.put(prefix + "late", b"x")
    assert watch.next(0.2) == []


# ---- leases --------------------------------------------------------------------------------


def test_revoking_a_lease_deletes_its_keys_at_once(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    lease = kv.grant_lease(60)
    kv.put(prefix + "node/1", b"me", lease)
    kv.put(prefix + "node/2", b"me too", lease)
    _, revision = kv.range_prefix(prefix)
    watch = watches(kv, prefix, revision + 1)
    kv.revoke_lease(lease)
    events = collect(watch, 2)
    assert events == [delete_event(prefix + "node/1", revision + 1),
                      delete_event(prefix + "node/2", revision + 1)]  # one revision
    assert kv.range_prefix(prefix)[0] == []
    assert kv.keep_alive(lease) == 0
    kv.revoke_lease(lease)  # already gone: no error


def test_a_lease_not_kept_alive_expires_with_its_keys(
        kv: KV, prefix: str, watches: Callable[[KV, str, int], Watch]) -> None:
    lease = kv.grant_lease(2)  # etcd's shortest lease is about 2 s
    kv.put(prefix + "node", b"me", lease)
    watch = watches(kv, prefix, kv.range_prefix(prefix)[1] + 1)
    if isinstance(kv, MemoryKV):
        kv.advance(2.5)
    [gone] = collect(watch, 1, timeout=15)
    assert (gone.kind, gone.key) == ("delete", prefix + "node")
    assert kv.get(prefix + "node") is None
    assert kv.keep_alive(lease) == 0


def test_keep_alive_keeps_a_lease_alive(kv: KV, prefix: str) -> None:
    lease = kv.grant_lease(2)
    kv.put(prefix + "node", b"me", lease)
    started = time.monotonic()
    for _ in range(8):  # 4 s, twice the TTL, renewed every 0.5 s
        if isinstance(kv, MemoryKV):
            kv.advance(0.5)
        else:
            time.sleep(0.5)  # the renewal cadence, not a wait for a condition
        assert kv.keep_alive(lease) == 2
    if not isinstance(kv, MemoryKV):
        assert time.monotonic() - started > 3
    assert kv.get(prefix + "node").value == b"me"
    kv.revoke_lease(lease)
    assert kv.keep_alive(lease) == 0
    assert kv.get(prefix + "node") is None


# ---- a real etcd that goes away, and one behind TLS and authentication ---------------------


def test_a_watch_outlives_the_request_timeout(etcd_v3: EtcdServer, prefix: str) -> None:
    kv = etcd_kv(etcd_v3, request_timeout=1)
    watch = kv.watch_prefix(prefix, kv.range_prefix(prefix)[1] + 1)
    try:
        assert watch.next(1.5) == []  # idle for longer than a request may take
        kv.put(prefix + "a", b"1")
        assert [e.key for e in collect(watch, 1)] == [prefix + "a"]
    finally:
        watch.cancel()
    assert_reader_ends(watch)


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_etcd_going_away_breaks_the_watch(how: str, prefix: str) -> None:
    server = EtcdServer.start()
    try:
        kv = etcd_kv(server, request_timeout=2)
        kv.put(prefix + "a", b"1")
        _, revision = kv.range_prefix(prefix)
        watch = kv.watch_prefix(prefix, revision + 1)
        assert watch.next(0.1) == []
        if how == "kill":
            server.kill()
        else:
            server.proc.terminate()
            server.proc.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(EtcdUnreachableError) as info:
            while time.monotonic() - started < 5:
                watch.next(0.5)
        assert time.monotonic() - started < 5
        assert str(info.value).startswith(
            f"cannot reach etcd at http://{server.endpoint} (watching {prefix}: ")
        assert "\n" not in str(info.value)
        assert_reader_ends(watch)
        with pytest.raises(EtcdUnreachableError):  # the watch is dead
            watch.next(0.1)
        # etcd back: re-read, then watch again from where the read left off.
        server.restart()
        kvs, now = kv.range_prefix(prefix)
        assert [k.key for k in kvs] == [prefix + "a"] and now >= revision
        again = kv.watch_prefix(prefix, now + 1)
        try:
            kv.put(prefix + "b", b"2")
            assert [e.key for e in collect(again, 1)] == [prefix + "b"]
        finally:
            again.cancel()
        assert_reader_ends(again)
    finally:
        server.stop()


def test_a_broken_stream_on_the_fake(prefix: str) -> None:
    """``MemoryKV.break_watches`` (etcd restarting): the events before the break come first."""
    kv = MemoryKV()
    watch = kv.watch_prefix(prefix, 0)
    kv.put(prefix + "a", b"1")
    kv.break_watches()
    assert [e.key for e in watch.next(1)] == [prefix + "a"]
    with pytest.raises(EtcdUnreachableError, match=f"watching {prefix}: the stream ended"):
        watch.next(1)
    kv.put(prefix + "b", b"2")
    with pytest.raises(EtcdUnreachableError):
        watch.next(0)


@dataclass(frozen=True)
class SecureEtcd:
    server: EtcdServer
    tls: TlsFiles
    client_cert: Path  # with no CommonName, unlike tls.client_cert
    client_key: Path


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """An etcd serving https with client certificates, and user authentication on.

    With both on, etcd's gateway refuses a client certificate that has a CommonName
    (HTTP 400: it cannot map the name to a user through the gateway): the watch's client
    gets one without, signed by the same CA.
    """
    directory = tmp_path_factory.mktemp("tls")
    tls = TlsFiles.create(directory)
    openssl = tools.system_tool("openssl", "openssl is needed to make the test certificates")
    cert, key, csr = directory / "nocn.pem", directory / "nocn.key", directory / "nocn.csr"
    for args in (["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/O=elastic-train",
                  "-keyout", str(key), "-out", str(csr)],
                 ["x509", "-req", "-in", str(csr), "-CA", str(tls.ca), "-CAkey",
                  str(directory / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile",
                  str(directory / "san.cnf"), "-out", str(cert)]):
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)
    server = EtcdServer.start(tls=tls, auth_password="s3cret")
    yield SecureEtcd(server, tls, cert, key)
    server.stop()


def test_a_watch_through_tls_and_authentication(secure_etcd: SecureEtcd, prefix: str
                                                 ) -> None:
    def client(password: str, cert: Path = secure_etcd.client_cert,
               key: Path = secure_etcd.client_key) -> EtcdKV:
        credentials = Credentials(str(secure_etcd.tls.ca), str(cert), str(key), "root",
                                  password)
        return EtcdKV(Endpoint("127.0.0.1", secure_etcd.server.port, "https"), credentials,
                      request_timeout=5)

    kv = client("s3cret")
    lease = kv.grant_lease(30)
    kv.put(prefix + "node", b"me", lease)
    revision = kv.get(prefix + "node").mod_revision
    # An expired token is replaced before the stream opens (etcd checks it only there).
    kv._client.session.headers["Authorization"] = "expired.token"
    watch = kv.watch_prefix(prefix, revision)
    try:
        kv.put(prefix + "other", b"x")
        assert kv.keep_alive(lease) == 30
        kv.revoke_lease(lease)
        events = collect(watch, 3)
        assert [(e.kind, e.key) for e in events] == [
            ("put", prefix + "node"), ("put", prefix + "other"), ("delete", prefix + "node")]
        assert events[0].mod_revision == revision
    finally:
        watch.cancel()
    assert_reader_ends(watch)
    with pytest.raises(RendezvousConnectionError, match="refused logging in as root"):
        client("guess").watch_prefix(prefix, 0)
    named = client("s3cret", secure_etcd.tls.client_cert, secure_etcd.tls.client_key)
    with pytest.raises(RendezvousConnectionError, match="CommonName of client"):
        named.watch_prefix(prefix, 0)


def test_memory_kv_counts_the_new_requests(prefix: str) -> None:
    kv = MemoryKV()
    lease = kv.grant_lease(5)
    kv.put(prefix + "a", b"", lease)
    kv.put_many_if_absent(prefix + "g", [(prefix + "g", b"")])
    kv.range_prefix(prefix)
    kv.keep_alive(lease)
    kv.watch_prefix(prefix, 0).cancel()
    kv.revoke_lease(lease)
    assert kv.requests == 7
