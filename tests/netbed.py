"""Separate hosts on one machine: a test bed of network namespaces, for multi-node proofs.

Every multi-node test that runs its "nodes" as agents on one host talks over loopback, where
the kernel announces every death at once. Real nodes are separate hosts: a host that loses
power, freezes or whose switch port dies says nothing. This bed makes N such hosts:

- each host is a **network namespace** of its own (``etb<id>-<n>``) with loopback up and one
  interface, ``eth0``, the end of a veth pair whose other end (``p<n>``) is a port of a Linux
  bridge (``br0``) that lives in a namespace of its own (``etb<id>-br``), the switch;
- each process started on a host gets a **UTS namespace** with the host's own name
  (``unshare --uts`` + ``hostname``), so ``socket.gethostname()`` is the host's name;
- names resolve between hosts as a cluster's DNS would: ``/etc/netns/<ns>/hosts``, which
  ``ip netns exec`` bind-mounts over ``/etc/hosts``, lists every host of the bed. With
  ``loopback_name=True`` a host's own name resolves to ``127.0.1.1`` instead (Debian's
  default ``/etc/hosts`` line), the setting in which gloo advertises loopback;
- an **etcd host** (``etcd=True``) runs a real etcd listening on that host's address.

**Addresses** are taken from 198.18.0.0/15 (RFC 2544: reserved for network benchmark tests,
never routed on the internet), host ``n`` at ``198.18.0.<n+1>/24``. **Nothing can leave** the
namespaces a bed makes: no veth end is in the root namespace (each pair is created directly
inside the host's and the switch's namespaces), the bridge has no uplink, and no host has a
default route, so a packet to any address outside 198.18.0.0/24 fails with "network is
unreachable" inside the host that sent it. Two beds never collide: their namespaces, hosts
files and interfaces are their own (``<id>`` is random), and the same addresses in two beds
are two separate networks.

**Faults** (each returns the ``time.time()`` at which it took effect):

- ``Host.kill()``: SIGKILL every process of the host (``ip netns pids``: the agent, its
  workers, its forkserver, etcd), a crash of everything on it: the host's kernel lives on and
  closes their sockets, so peers see EOF or a refused connection at once (as when a node's
  processes die, e.g. killed by the OOM killer). For a host that vanishes silently (power,
  panic) use ``cable_down`` or ``freeze``.
- ``Host.cable_down()`` / ``cable_up()``: the switch port's link down / up: silence both
  ways (no FIN, no RST; the host's processes live on and their kernel retransmits).
- ``Host.freeze()`` / ``thaw()``: SIGSTOP / SIGCONT every process of the host (a VM pause, a
  long GC): the host's kernel still ACKs TCP, its programs answer nothing.
- ``Host.drop_incoming(peer=None)`` / ``drop_outgoing(peer=None)`` / ``restore()``: a one-way
  loss (iptables DROP in the receiving host's INPUT chain, so the sender sees silence, not
  EPERM); needs ``iptables``.
- ``Host.slow_link(rate=..., delay_ms=...)`` / ``fast_link()``: tc on both ends of the
  host's cable: ``tbf`` for a rate, ``netem`` for a delay (the kernel needs ``sch_netem``;
  ``Netbed.supports("netem")`` says whether it has it).

**Teardown** (``Netbed.close``, also on a failed test through the ``netbed`` fixture and the
context manager): every process of every host is SIGKILLed, every namespace deleted, every
``/etc/netns/<ns>`` removed. Processes started with ``Host.popen`` are also SIGKILLed when
the thread that started them dies (PR_SET_PDEATHSIG), and a bed whose owner process died
without teardown (``kill -9`` of pytest) is removed by the next bed made on the machine.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); scripts/install-test-deps.sh
installs them with iptables. Without them ``require()`` skips the test with the reason,
except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests import procfs, tools

PREFIX = "etb"  # every namespace a bed makes starts with it (and only theirs)
SUBNET = "198.18.0"  # a /24 of 198.18.0.0/15 (RFC 2544, benchmark tests: never routed)
PREFIX_LEN = 24
IFNAME = "eth0"  # a host's interface, the name for GLOO_SOCKET_IFNAME
LOOPBACK_NAME_ADDR = "127.0.1.1"  # Debian's /etc/hosts line for the host's own name
OWNERS = Path("/run/etb")  # <id> -> the pid of the process that made bed <id>
ETCD_PORT = 2379
COMMAND_TIMEOUT = 30.0
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetbedError(RuntimeError):
    """A command of the bed failed, or a fault did not take effect in time."""


# ---------------------------------------------------------------- availability


_REASON: list[str | None] = []  # cached unavailable_reason()


def unavailable_reason() -> str | None:
    """Why no bed can be made here (None: it can). Probes by making a namespace once."""
    if _REASON:
        return _REASON[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root (ip netns add)"
    else:
        for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
            if not tools.system_tool_available(tool):
                reason = (f"{tool} is not installed: run scripts/install-test-deps.sh "
                          f"(apt: {package})")
                break
    if reason is None:
        probe = f"{PREFIX}{_random_id()}-probe"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT)
        if made.returncode != 0:
            reason = f"cannot make a network namespace: {made.stderr.strip()}"
        else:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True,
                           timeout=COMMAND_TIMEOUT)
    _REASON.append(reason)
    return reason


def require() -> None:
    """Skip the calling test when no bed can be made here; fail instead under CI=true."""
    reason = unavailable_reason()
    if reason is not None:

        tools.missing(f"multi-host test bed: {reason}")


# ---------------------------------------------------------------- small tools


def _random_id() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def _run(argv: Sequence[str], check: bool = True, timeout: float = COMMAND_TIMEOUT
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise NetbedError(f"{' '.join(argv)} failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()}")
    return done


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stamp_lines(source: Any, log: Path) -> None:
    """Copy ``source``'s lines to ``log`` as ``<time.time()> <line>`` until EOF."""
    with source, open(log, "ab", buffering=0) as out:
        for line in source:
            out.write(b"%.6f " % time.time() + line)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_state(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped; ``""``: gone)."""
    return procfs.state(pid)


def namespace_pids(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (never this process)."""
    done = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _signal_until(ns: str, sig: int, done: Callable[[list[int]], bool], what: str,
                  timeout: float) -> None:
    """Send ``sig`` to every process of ``ns`` again and again (a process forked meanwhile
    is caught by the next round) until ``done(pids)``; NetbedError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pids = namespace_pids(ns)
        if done(pids):
            return
        if time.monotonic() > deadline:
            raise NetbedError(f"{what}: processes {pids} of {ns} after {timeout:g} s")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(0.01)


def _delete_namespace(ns: str) -> None:
    _signal_until(ns, signal.SIGKILL, lambda pids: not pids, "teardown", 20.0)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces of beds whose owner process is gone (a test run killed before
    its teardown); returns their names. Only names starting with PREFIX are looked at."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.startswith(PREFIX)]
    removed = []
    for ns in names:
        bed_id = ns[len(PREFIX):].split("-", 1)[0]
        owner = OWNERS / bed_id
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _alive(pid):
            continue
        _delete_namespace(ns)
        owner.unlink(missing_ok=True)
        removed.append(ns)
    return removed


# ---------------------------------------------------------------- hosts


@dataclass
class Host:
    """One host of a bed: a network namespace with its own name, address and cable."""

    bed: Netbed
    index: int
    name: str
    ns: str
    ip: str
    port: str  # its cable's end on the switch (in the bridge's namespace)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)

    ifname: str = IFNAME

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host: in its network namespace (hosts file included) and
        a UTS namespace named after the host."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None,
              log: Path | None = None, cwd: Path | None = None, timestamps: bool = False
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host in a process group of its own, stdout and stderr
        appended to ``log`` (default: ``<bed dir>/<host>-<n>.log``). ``timestamps``: each
        line is written as ``<time.time()> <line>``, stamped when it arrived (a thread of
        this process reads the output; set PYTHONUNBUFFERED=1 for Python programs). The
        process gets SIGKILL when the thread that called this dies; ``kill()`` and teardown
        end it."""
        if log is None:
            log = self.bed.dir / f"{self.name}-{len(self.procs)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.argv(argv), stdout=subprocess.PIPE if timestamps
                                    else out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        if timestamps:
            assert proc.stdout is not None
            threading.Thread(target=_stamp_lines, args=(proc.stdout, log),
                             name=f"log-{self.name}", daemon=True).start()
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """Run a short command on this host; its output (NetbedError if it fails)."""
        return _run(self.argv(argv), check=check, timeout=timeout)

    def call(self, fn: Callable[[], T], timeout: float = COMMAND_TIMEOUT) -> T:
        """``fn()`` in a thread of this process that joined the host's network namespace:
        sockets it creates belong to the host (and stay there when used from elsewhere).
        Name resolution is the test machine's, not the host's (use ``run`` for that)."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                fd = os.open(f"/run/netns/{self.ns}", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL("libc.so.6", use_errno=True)
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.ns}")
                finally:
                    os.close(fd)
                result["value"] = fn()
            except BaseException as error:  # handed to the caller
                result["error"] = error

        thread = threading.Thread(target=target, name=f"netns-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise NetbedError(f"a call on {self.name} did not return within {timeout:g} s")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def connect(self, address: str, port: int, timeout: float = 5.0) -> socket.socket:
        """A TCP connection from this host (a socket of its namespace) to address:port."""
        return self.call(lambda: socket.create_connection((address, port), timeout=timeout))

    def pids(self) -> list[int]:
        """Every process running on this host."""
        return namespace_pids(self.ns)

    def leftovers(self, within: float) -> list[str]:
        """The command lines of this host's processes still there after ``within`` seconds
        (those a process ended leave a moment later: its forkserver, its resource
        tracker)."""
        deadline = time.monotonic() + within
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = []
        for pid in self.pids():
            try:
                left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                            .decode(errors="replace")[:160])
            except OSError:
                continue
        return left

    # ------------------------------------------------------------ faults

    def _kill_started(self) -> None:
        """SIGKILL the process group of every process ``popen`` started that still runs:
        one started a moment ago may not have entered the namespace yet (``ip netns pids``
        misses it) and would enter it after the sweep. Unreaped, their pids are not reused."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def kill(self, timeout: float = 10.0) -> float:
        """SIGKILL every process of the host, until none is left; the time of the kill."""
        at = time.time()
        self._kill_started()
        _signal_until(self.ns, signal.SIGKILL, lambda pids: not pids, f"kill {self.name}",
                      timeout)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        return at

    def freeze(self, timeout: float = 10.0) -> float:
        """SIGSTOP every process of the host (until all are stopped); the time of the stop."""
        at = time.time()
        _signal_until(self.ns, signal.SIGSTOP,
                      lambda pids: all(process_state(p) in ("T", "t", "") for p in pids),
                      f"freeze {self.name}", timeout)
        return at

    def thaw(self, timeout: float = 10.0) -> float:
        """SIGCONT every process of the host; the time of the first SIGCONT."""
        at = time.time()
        _signal_until(self.ns, signal.SIGCONT,
                      lambda pids: all(process_state(p) not in ("T", "t") for p in pids),
                      f"thaw {self.name}", timeout)
        return at

    def cable_down(self) -> float:
        """Pull the host's cable: its switch port down, silence both ways."""
        at = time.time()
        self.bed.bridge_ip(["link", "set", self.port, "down"])
        return at

    def cable_up(self) -> float:
        """Put the cable back: the switch port up (the bridge forwards at once: no STP)."""
        self.bed.bridge_ip(["link", "set", self.port, "up"])
        return time.time()

    def _iptables(self, ns: str, rule: list[str]) -> None:
        if not tools.system_tool_available("iptables"):
            raise NetbedError("iptables is not installed: run scripts/install-test-deps.sh")
        _run(["ip", "netns", "exec", ns, "iptables", "-w", "10", "-A", *rule])
        self._rules.append((ns, rule))

    def drop_incoming(self, peer: Host | None = None) -> float:
        """Packets to this host (from ``peer``, else from every host) are lost on arrival:
        the sender sees silence. Loopback is untouched."""
        source = ["-s", peer.ip] if peer else []
        self._iptables(self.ns, ["INPUT", "-i", self.ifname, *source, "-j", "DROP"])
        return time.time()

    def drop_outgoing(self, peer: Host | None = None) -> float:
        """Packets from this host (to ``peer``, else to every host) are lost: dropped on
        arrival at the receivers, so this host's sends succeed and go nowhere."""
        for other in [peer] if peer else [h for h in self.bed.hosts if h is not self]:
            self._iptables(other.ns, ["INPUT", "-i", other.ifname, "-s", self.ip, "-j",
                                      "DROP"])
        return time.time()

    def restore(self) -> float:
        """Remove every loss rule this host's ``drop_*`` calls added."""
        while self._rules:
            ns, rule = self._rules.pop()
            _run(["ip", "netns", "exec", ns, "iptables", "-w", "10", "-D", *rule], check=False)
        return time.time()

    def slow_link(self, rate: str | None = None, delay_ms: float | None = None) -> None:
        """Slow the host's cable both ways: ``rate`` (tc rate, e.g. ``1mbit``) by ``tbf``,
        ``delay_ms`` each way by ``netem`` (needs the kernel's sch_netem)."""
        assert rate or delay_ms, "a rate or a delay"
        if delay_ms is not None:
            spec = ["netem", "delay", f"{delay_ms}ms", *(["rate", rate] if rate else [])]
        else:
            spec = ["tbf", "rate", str(rate), "burst", "32kbit", "latency", "400ms"]
        _run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.ifname,
              "root", *spec])
        self.bed.bridge_ip(["link", "show", self.port])  # the port exists
        _run(["ip", "netns", "exec", self.bed.bridge_ns, "tc", "qdisc", "replace", "dev",
              self.port, "root", *spec])

    def fast_link(self) -> None:
        """Remove ``slow_link``'s queueing disciplines."""
        for ns, dev in ((self.ns, self.ifname), (self.bed.bridge_ns, self.port)):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                 check=False)


# ---------------------------------------------------------------- etcd


@dataclass
class NetEtcd:
    """A real etcd on a host of the bed; ``endpoint`` is IP:PORT of its client URL."""

    host: Host
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log: Path

    @property
    def endpoint(self) -> str:
        return f"{self.host.ip}:{ETCD_PORT}"

    @classmethod
    def start(cls, host: Host, timeout: float = 20.0) -> NetEtcd:
        from tests.etcd_server import etcd_binary

        data_dir = host.bed.dir / f"etcd-{host.name}"
        data_dir.mkdir(parents=True, exist_ok=True)
        client = f"http://{host.ip}:{ETCD_PORT}"
        peer = f"http://{host.ip}:{ETCD_PORT + 1}"
        log = data_dir / "etcd.log"
        argv = [etcd_binary(), "--name", host.name, "--data-dir", str(data_dir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{host.name}={peer}", "--log-level", "warn",
                "--logger", "zap"]
        etcd = cls(host, host.popen(argv, log=log), data_dir, log)
        etcd.wait_ready(timeout)
        return etcd

    def healthy(self) -> bool:
        """Whether etcd answers /health as healthy (asked from its own host)."""
        def ask() -> bool:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as r:
                return b'"true"' in r.read()

        try:
            return self.host.call(ask, timeout=5)
        except (OSError, ValueError, NetbedError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.healthy():
                return
            time.sleep(0.05)
        raise NetbedError(f"etcd on {self.host.name} did not start:\n"
                          f"{self.log.read_text(errors='replace')[-2000:]}")


# ---------------------------------------------------------------- the bed


class Netbed:
    """N hosts on one switch (see the module docstring). ``Netbed.create`` makes one;
    ``close`` removes everything it made. A context manager too."""

    def __init__(self, bed_id: str, workdir: Path, keep_dir: bool,
                 loopback_name: bool) -> None:
        self.id = bed_id
        self.dir = workdir
        self._keep_dir = keep_dir
        self.loopback_name = loopback_name
        self.bridge_ns = f"{PREFIX}{bed_id}-br"
        self.hosts: list[Host] = []
        self.etcd: NetEtcd | None = None
        self._namespaces: list[str] = []
        self._closed = False

    @classmethod
    def create(cls, names: Sequence[str] = ("node-a", "node-b"), etcd: bool = False,
               loopback_name: bool = False, workdir: Path | None = None) -> Netbed:
        """Hosts named ``names`` (plus one named ``etcd`` running etcd, when ``etcd``);
        ``loopback_name``: each host's own name resolves to 127.0.1.1 on that host (Debian's
        default). Logs and etcd's data go to ``workdir`` (kept) or a temporary dir (removed
        on close)."""
        reason = unavailable_reason()
        if reason is not None:
            raise NetbedError(reason)
        all_names = [*names, *(["etcd"] if etcd else [])]
        assert len(set(all_names)) == len(all_names), f"host names repeat: {all_names}"
        assert len(all_names) < 250
        sweep_stale()
        bed_id = _random_id()
        keep = workdir is not None
        workdir = workdir or Path(tempfile.mkdtemp(prefix=f"netbed-{bed_id}-"))
        workdir.mkdir(parents=True, exist_ok=True)
        bed = cls(bed_id, workdir, keep, loopback_name)
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / bed_id).write_text(str(os.getpid()))
        try:
            bed._build(all_names)
            if etcd:
                bed.etcd = NetEtcd.start(bed.host("etcd"))
        except BaseException:
            bed.close()
            raise
        return bed

    def _build(self, names: Sequence[str]) -> None:
        self._add_namespace(self.bridge_ns)
        self.bridge_ip(["link", "add", "br0", "type", "bridge"])
        self.bridge_ip(["link", "set", "br0", "up"])
        self.bridge_ip(["link", "set", "lo", "up"])
        for index, name in enumerate(names):
            host = Host(self, index, name, f"{PREFIX}{self.id}-{index}",
                        f"{SUBNET}.{index + 1}", f"p{index}")
            self._add_namespace(host.ns)
            # both ends made inside their namespaces: no interface ever in the root one
            _run(["ip", "link", "add", IFNAME, "netns", host.ns, "type", "veth", "peer",
                  "name", host.port, "netns", self.bridge_ns])
            self.bridge_ip(["link", "set", host.port, "master", "br0"])
            self.bridge_ip(["link", "set", host.port, "up"])
            for argv in (["link", "set", "lo", "up"],
                         ["addr", "add", f"{host.ip}/{PREFIX_LEN}", "dev", IFNAME],
                         ["link", "set", IFNAME, "up"]):
                _run(["ip", "-n", host.ns, *argv])
            self.hosts.append(host)
        for host in self.hosts:
            self._write_hosts_file(host)

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)

    def _write_hosts_file(self, host: Host) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for other in self.hosts:
            if other is host and self.loopback_name:
                lines.append(f"{LOOPBACK_NAME_ADDR}\t{other.name}")
            else:
                lines.append(f"{other.ip}\t{other.name}")
        directory = Path("/etc/netns") / host.ns
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def bridge_ip(self, argv: Sequence[str]) -> None:
        """``ip`` in the switch's namespace."""
        _run(["ip", "-n", self.bridge_ns, *argv])

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def supports(self, feature: str) -> bool:
        """Whether a fault's tool works here: ``iptables`` (one-way loss), ``netem`` (a
        delay; a kernel module), ``tbf`` (a rate)."""
        host = self.hosts[0]
        if feature == "iptables":
            return tools.system_tool_available("iptables") and _run(
                ["ip", "netns", "exec", host.ns, "iptables", "-S"], check=False
            ).returncode == 0
        spec = {"netem": ["netem", "delay", "1ms"],
                "tbf": ["tbf", "rate", "1gbit", "burst", "32kbit", "latency", "50ms"]}[feature]
        added = _run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", "lo",
                      "root", *spec], check=False)
        _run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "del", "dev", "lo", "root"],
             check=False)
        return tools.system_tool_available("tc") and added.returncode == 0

    def close(self) -> None:
        """Kill every process of every host, delete the namespaces and hosts files."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for host in self.hosts:
            host._kill_started()
        for ns in reversed(self._namespaces):
            try:
                _delete_namespace(ns)
            except Exception as error:  # go on removing the others, report after
                errors.append(error)
        for host in self.hosts:
            for proc in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        (OWNERS / self.id).unlink(missing_ok=True)
        if not self._keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise NetbedError(f"teardown of bed {self.id}: {errors}")

    def __enter__(self) -> Netbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def netbed(*args: Any, **kwargs: Any) -> Iterator[Netbed]:
    """``Netbed.create(...)`` as a context manager."""
    bed = Netbed.create(*args, **kwargs)
    try:
        yield bed
    finally:
        bed.close()
