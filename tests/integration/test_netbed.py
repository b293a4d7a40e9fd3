"""The multi-host test bed itself (tests/netbed.py): each fault does what it claims.

A line echo server runs on host B; the test talks to it from host A over a socket made in
A's namespace. Kill: A sees EOF at once and a new connection is refused. Cable pulled: an
exchange times out (silence, no error), and when the cable is back the same connection
carries it. Frozen: silence (B's kernel still ACKs, its program answers nothing), thawed:
the answer comes. One-way loss (iptables): UDP one way arrives, the other way does not.
Slow link (tc): a transfer takes the time its rate says. Names: each host is called by its
own name and finds the others by theirs; Debian's loopback line when asked. Teardown: no
namespace, hosts file or process is left, also after the owner was SIGKILLed.
"""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import netbed as nb
from tests import tools

Factory = Callable[..., nb.Netbed]
PORT = 7000
SILENCE = 1.5  # seconds of no answer that count as silence here (answers take ~1 ms)

ECHO = textwrap.dedent("""
    import socket, sys, threading
    server = socket.create_server(("0.0.0.0", int(sys.argv[1])), reuse_port=True)
    def serve(conn):
        with conn:
            for line in conn.makefile("rb"):
                conn.sendall(line)
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
""")


def echo_server(host: nb.Host, client: nb.Host, timeout: float = 20.0) -> socket.socket:
    """Start the echo server on ``host``; a connection to it from ``client`` once it
    listens."""
    host.popen([sys.executable, "-c", ECHO, str(PORT)])
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = client.connect(host.ip, PORT, timeout=2.0)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    assert exchange(conn, b"hello") == b"hello\n"
    return conn


def exchange(conn: socket.socket, data: bytes, timeout: float = 5.0) -> bytes:
    """Send a line, return the line that comes back (b"" at EOF)."""
    conn.settimeout(timeout)
    conn.sendall(data + b"\n")
    return receive_line(conn, timeout)


def receive_line(conn: socket.socket, timeout: float) -> bytes:
    conn.settimeout(timeout)
    got = b""
    while not got.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            return got
        got += chunk
    return got


def test_hosts_have_their_own_names_addresses_and_nothing_else(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    assert a.run(["hostname"]).stdout.strip() == "node-a"
    assert b.run(["hostname"]).stdout.strip() == "node-b"
    assert a.run(["getent", "hosts", "node-b"]).stdout.split()[0] == b.ip
    # what gloo does to choose the address it advertises
    resolve_own = [sys.executable, "-c",
                   "import socket; print(socket.gethostbyname(socket.gethostname()))"]
    assert a.run(resolve_own).stdout.strip() == a.ip
    assert a.ip.startswith("198.18.") and b.ip.startswith("198.18.")
    # no default route: an address outside the bed is unreachable from inside it
    with pytest.raises(OSError) as raised:
        a.connect("192.0.2.1", 80, timeout=2.0)
    assert raised.value.errno == errno.ENETUNREACH
    conn = echo_server(b, a)
    assert exchange(conn, b"across") == b"across\n"
    conn.close()


def test_loopback_name_resolves_the_own_name_to_127_0_1_1(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"], loopback_name=True)
    a, b = bed.hosts
    assert a.run(["getent", "hosts", "node-a"]).stdout.split()[0] == nb.LOOPBACK_NAME_ADDR
    assert a.run(["getent", "hosts", "node-b"]).stdout.split()[0] == b.ip
    assert a.run([sys.executable, "-c",
                  "import socket; print(socket.gethostbyname(socket.gethostname()))"]
                 ).stdout.strip() == nb.LOOPBACK_NAME_ADDR


def test_kill_closes_the_peers_connection_at_once(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    conn = echo_server(b, a)
    assert b.pids()
    b.kill()
    started = time.monotonic()
    try:
        assert receive_line(conn, timeout=5.0) == b""
    except ConnectionResetError:
        pass
    assert time.monotonic() - started < 1.0
    assert b.pids() == []
    with pytest.raises(ConnectionRefusedError):
        a.connect(b.ip, PORT, timeout=2.0)


@pytest.mark.slow
def test_cable_down_is_silence_and_cable_up_carries_the_same_connection(
        netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    conn = echo_server(b, a)
    b.cable_down()
    with pytest.raises(TimeoutError):
        exchange(conn, b"lost?", timeout=SILENCE)
    assert b.pids(), "a pulled cable leaves the host's processes running"
    b.cable_up()
    assert receive_line(conn, timeout=20.0) == b"lost?\n"  # retransmitted
    assert exchange(conn, b"again") == b"again\n"


@pytest.mark.slow
def test_freeze_is_silence_and_thaw_answers(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    conn = echo_server(b, a)
    b.freeze()
    assert all(nb.process_state(pid) == "T" for pid in b.pids())
    with pytest.raises(TimeoutError):
        exchange(conn, b"frozen?", timeout=SILENCE)
    b.thaw()
    assert receive_line(conn, timeout=5.0) == b"frozen?\n"
    assert exchange(conn, b"again") == b"again\n"


def _udp_arrives(sender: nb.Host, receiver: nb.Host, timeout: float = 0.5) -> bool:
    inbox = receiver.call(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    outbox = sender.call(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    with inbox, outbox:
        inbox.bind((receiver.ip, 0))
        inbox.settimeout(timeout)
        outbox.sendto(b"x", (receiver.ip, inbox.getsockname()[1]))
        try:
            return inbox.recv(16) == b"x"
        except TimeoutError:
            return False


@pytest.mark.slow
def test_one_way_loss(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    if not bed.supports("iptables"):
        tools.missing("iptables is not installed: run scripts/install-test-deps.sh")
    assert _udp_arrives(a, b) and _udp_arrives(b, a)
    a.drop_outgoing(b)
    assert not _udp_arrives(a, b)
    assert _udp_arrives(b, a)
    a.restore()
    b.drop_incoming(a)
    assert not _udp_arrives(a, b)
    assert _udp_arrives(b, a)
    b.restore()
    assert _udp_arrives(a, b)


def _transfer_seconds(sender: nb.Host, receiver: nb.Host, size: int) -> float:
    server = receiver.call(lambda: socket.create_server((receiver.ip, 0)))
    with server:
        client = sender.connect(receiver.ip, server.getsockname()[1])
        conn, _ = server.accept()
        with client, conn:
            conn.settimeout(30)
            started = time.monotonic()
            client.sendall(b"x" * size)
            got = 0
            while got < size:
                got += len(conn.recv(65536))
            return time.monotonic() - started


@pytest.mark.slow
def test_slow_link_rate(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    if not bed.supports("tbf"):
        tools.missing("tc (iproute2) with the tbf queueing discipline is needed")
    fast = _transfer_seconds(a, b, 250_000)
    b.slow_link(rate="2mbit")  # 250 kB = 2 Mbit: about a second
    slow = _transfer_seconds(a, b, 250_000)
    assert slow > 0.7 and slow > 5 * fast, (fast, slow)
    b.fast_link()
    assert _transfer_seconds(a, b, 250_000) < 0.5


def test_slow_link_delay(netbed: Factory) -> None:
    bed = netbed(["node-a", "node-b"])
    a, b = bed.hosts
    if not bed.supports("netem"):
        pytest.skip("this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): no delay faults")
    b.slow_link(delay_ms=200)
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        a.connect(b.ip, 1, timeout=5)  # a SYN and its RST: one round trip
    assert time.monotonic() - started > 0.35


def test_teardown_removes_namespaces_hosts_files_and_processes() -> None:
    nb.require()
    bed = nb.Netbed.create(["node-a"])
    proc = bed.hosts[0].popen(["sleep", "600"])
    names = [bed.bridge_ns, bed.hosts[0].ns]
    bed.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert not any((Path("/etc/netns") / name).exists() for name in names)
    assert proc.poll() == -signal.SIGKILL


OWNER = textwrap.dedent("""
    import sys, time
    from tests.netbed import Netbed
    bed = Netbed.create(["node-a", "node-b"])
    proc = bed.hosts[1].popen(["sleep", "600"])
    print(bed.bridge_ns, *[h.ns for h in bed.hosts], proc.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_a_killed_owner_leaves_no_process_and_the_next_bed_sweeps_its_namespaces() -> None:
    nb.require()
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE,
                             cwd=Path(__file__).resolve().parents[2], text=True)
    try:
        *names, pid = owner.stdout.readline().split()  # type: ignore[union-attr]
    finally:
        owner.kill()
        owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while nb._alive(int(pid)) and nb.process_state(int(pid)) != "Z":
        assert time.monotonic() < deadline, "the host's process outlived its owner"
        time.sleep(0.01)
    assert set(names) <= set(nb.sweep_stale())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_without_root_the_bed_skips_but_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nb, "_REASON", [])
    monkeypatch.setattr(nb.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="network namespaces need root"):
        nb.require()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="network namespaces need root"):
        nb.require()
