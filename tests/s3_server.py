"""A real S3 endpoint for tests: moto's server (``moto_server``, the ``moto[server]`` of the
``dev`` extra) as a process of its own, on a free loopback port, stopped after.

``S3Server.start()`` serves on loopback; ``S3Server.start_on(host)`` serves on a host of the
network-namespace test bed (tests/netbed.py), reachable from the bed's other hosts only.
moto keeps every bucket and object in the server's memory: nothing on disk, nothing left
after ``stop``. It accepts any credentials; ``client()`` and ``env()`` use ``testing`` /
``testing`` in ``us-east-1`` and path-style addressing (the bucket in the path, as S3-
compatible stores other than AWS need).

``freeze()`` / ``thaw()`` SIGSTOP / SIGCONT the server: an endpoint that stops answering
(the kernel still accepts connections, nothing replies) and later answers again with all
its data. Freeze only a server of your own, never the session's ``s3_server`` fixture.

A missing ``moto_server`` (or boto3) skips the test, except under ``CI=true`` where it
fails: CI must run them (``make setup`` installs both).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tests import tools
from tests.netbed import process_state

if TYPE_CHECKING:
    from tests.netbed import Host

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
START_TIMEOUT = 20.0
SIGNAL_TIMEOUT = 5.0
NETBED_PORT = 9000  # a bed host's own namespace: every port is free
T = TypeVar("T")


def moto_binary() -> str:
    """``moto_server`` next to this interpreter (the venv's bin), else where
    ``tests.tools.installed_tool`` finds the project's programs (skip / CI failure)."""
    beside = Path(sys.executable).parent / "moto_server"
    if os.access(beside, os.X_OK):
        return str(beside)
    return tools.installed_tool("moto_server")


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        tools.missing("boto3 is not installed: run make setup (pip install -e '.[dev,etcd,s3]')")
    return boto3


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it dies (SIGKILL, not
    SIGTERM: a frozen server would not act on SIGTERM)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """One moto server; ``endpoint`` is its ``http://ADDRESS:PORT`` URL."""

    def __init__(self, proc: subprocess.Popen[bytes], address: str, port: int, log: Path,
                 workdir: Path | None, host: Host | None) -> None:
        self.proc = proc
        self.address = address
        self.port = port
        self.log = log
        self._workdir = workdir  # removed by stop(); None: the bed's dir, kept
        self.host = host  # the bed host it runs on; None: this machine's loopback

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    # ------------------------------------------------------------ start, stop

    @classmethod
    def start(cls, host: str = "127.0.0.1", port: int = 0, authenticate: bool = False
              ) -> S3Server:
        """A server on ``host``:``port`` (0: a free port, chosen again if taken meanwhile).
        ``authenticate``: every request must be signed by a key the server knows (moto's
        IAM, which knows none here): any credentials are refused, as wrong ones are."""
        env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if authenticate else {})}
        binary = moto_binary()
        last_error = ""
        for _ in range(3 if port == 0 else 1):
            workdir = Path(tempfile.mkdtemp(prefix="s3-test-"))
            chosen = port or free_port(host)
            log = workdir / "moto.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen([binary, "-H", host, "-p", str(chosen)], stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=_die_with_parent,
                                        env=env)
            server = cls(proc, host, chosen, log, workdir, None)
            if server._wait_ready(START_TIMEOUT):
                return server
            last_error = server.log_tail()
            server.stop()
        raise RuntimeError(f"moto_server did not start:\n{last_error}")

    @classmethod
    def start_on(cls, host: Host, address: str | None = None, port: int = NETBED_PORT
                 ) -> S3Server:
        """A server on a host of the test bed, listening on ``address`` (default: the host's
        own, reachable from the other hosts). Its log is in the bed's directory; the bed's
        teardown ends it too. Requests to it must come from inside the bed: use
        ``server.call(fn)`` (or ``some_host.call``) for a client of this process, and
        ``Host.popen(argv, env={**os.environ, **server.env()})`` for a worker."""
        address = address or host.ip
        log = host.bed.dir / f"s3-{host.name}.log"
        proc = host.popen([moto_binary(), "-H", address, "-p", str(port)], log=log)
        server = cls(proc, address, port, log, None, host)
        if not server._wait_ready(START_TIMEOUT):
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"moto_server did not start on {host.name}:\n{tail}")
        return server

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.answers(timeout=1.0):
                return True
            time.sleep(0.05)
        return False

    def answers(self, timeout: float = 1.0) -> bool:
        """Whether the server answers an S3 request (ListBuckets) within ``timeout``."""
        def ask() -> bool:
            with urllib.request.urlopen(self.endpoint + "/", timeout=timeout) as response:
                return response.status == 200 and b"ListAllMyBucketsResult" in response.read()

        try:
            return self.call(ask)
        except urllib.error.HTTPError:  # an answer: a server that authenticates refuses
            return True                  # an unsigned request (moto: 403 or 500)
        except (OSError, ValueError, RuntimeError):  # refused, timed out; NetbedError
            return False

    def stop(self) -> None:
        """SIGKILL the server (frozen or not) and wait for it; its data is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------ faults

    def _signal(self, sig: int, stopped: bool) -> float:
        assert self.proc.poll() is None, "the server is not running"
        at = time.time()
        os.killpg(self.proc.pid, sig)
        deadline = time.monotonic() + SIGNAL_TIMEOUT
        while (process_state(self.proc.pid) == "T") != stopped:
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server {self.proc.pid}: state "
                                   f"{process_state(self.proc.pid)!r} {SIGNAL_TIMEOUT:g} s after "
                                   f"signal {sig}")
            time.sleep(0.005)
        return at

    def freeze(self) -> float:
        """SIGSTOP the server: connections are still accepted, nothing is answered; its data
        stays. Returns the ``time.time()`` of the signal."""
        return self._signal(signal.SIGSTOP, stopped=True)

    def thaw(self) -> float:
        """SIGCONT a frozen server: it answers again, with the data it had."""
        return self._signal(signal.SIGCONT, stopped=False)

    # ------------------------------------------------------------ clients

    def call(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """``fn()`` where the server can be reached: here for a loopback server, in the
        bed host's network namespace for one started with ``start_on``."""
        return fn() if self.host is None else self.host.call(fn, timeout=timeout)

    def env(self) -> dict[str, str]:
        """What a worker process needs in its environment to reach this server with boto3's
        defaults (botocore reads AWS_ENDPOINT_URL since 1.31)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self, connect_timeout: float = 5.0, read_timeout: float = 10.0,
               max_attempts: int | None = None) -> Any:
        """A boto3 S3 client of this server: dummy credentials, us-east-1, path-style
        addressing. ``max_attempts``: botocore's total attempts per call (1: no retry;
        None: botocore's default)."""
        boto3 = _boto3()
        from botocore.config import Config

        config = Config(region_name=REGION, s3={"addressing_style": "path"},
                        connect_timeout=connect_timeout, read_timeout=read_timeout,
                        retries=None if max_attempts is None
                        else {"mode": "standard", "total_max_attempts": max_attempts})
        session = boto3.session.Session(aws_access_key_id=ACCESS_KEY,
                                        aws_secret_access_key=SECRET_KEY, region_name=REGION)
        return session.client("s3", endpoint_url=self.endpoint, config=config)

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an error if it exists)."""
        client = self.client()
        self.call(lambda: client.create_bucket(Bucket=name))
