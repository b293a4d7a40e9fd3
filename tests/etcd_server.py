"""Real etcd servers for tests: free loopback ports, a temporary data dir, stopped after.

``EtcdServer.start(v2=True)`` serves the v2 API too (etcd 3.4/3.5 ``--enable-v2``, what
torch's ``etcd`` / ``etcd-v2`` backends need); without it only the v3 API is served, like
etcd 3.6. ``tls=TlsFiles`` serves https and requires client certificates; ``auth`` turns
on etcd's user authentication with a root user. A missing ``etcd`` binary skips the test,
except under ``CI=true`` where it fails: CI must run them.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests import tools

START_TIMEOUT = 20.0


def etcd_binary() -> str:
    """The etcd executable (see ``tests.tools.system_tool``)."""
    return tools.system_tool("etcd", "etcd is not installed: run scripts/install-test-deps.sh "
                                     "(apt: etcd-server) or put etcd >= 3.4 on PATH")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() still stops it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made by openssl."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def create(cls, directory: Path) -> TlsFiles:
        openssl = tools.system_tool("openssl", "openssl is needed to make the test certificates")
        d = directory
        ext = d / "san.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n")

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
        for name in ("server", "client"):
            run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
                str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
            run("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile",
                str(ext), "-out", str(d / f"{name}.pem"))
        return cls(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                   d / "client.key")


class EtcdServer:
    """One etcd member on loopback; ``endpoint`` is HOST:PORT of its client URL."""

    def __init__(self, proc: subprocess.Popen[bytes], data_dir: Path, port: int,
                 v2: bool, tls: TlsFiles | None, log: Path) -> None:
        self.proc = proc
        self.argv = list(proc.args)  # type: ignore[arg-type]
        self.data_dir = data_dir
        self.port = port
        self.v2 = v2
        self.tls = tls
        self.log = log
        self.user: str | None = None
        self.password: str | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @classmethod
    def start(cls, v2: bool = False, tls: TlsFiles | None = None,
              auth_password: str | None = None) -> EtcdServer:
        binary = etcd_binary()
        last_error = ""
        for _ in range(3):  # a port taken between choosing and binding: choose again
            data_dir = Path(tempfile.mkdtemp(prefix="etcd-test-"))
            port, peer = free_port(), free_port()
            scheme = "https" if tls else "http"
            client_url = f"{scheme}://127.0.0.1:{port}"
            peer_url = f"http://127.0.0.1:{peer}"
            argv = [binary, "--name", "test", "--data-dir", str(data_dir / "data"),
                    "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                    "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", f"test={peer_url}", "--log-level", "warn",
                    "--logger", "zap"]
            if v2:
                argv.append("--enable-v2")
            if tls:
                argv += ["--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key),
                         "--client-cert-auth", "--trusted-ca-file", str(tls.ca)]
            log = data_dir / "etcd.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_die_with_parent)
            server = cls(proc, data_dir, port, v2, tls, log)
            if server._wait_ready():
                if auth_password is not None:
                    server._enable_auth(auth_password)
                return server
            last_error = log.read_text(errors="replace")[-2000:]
            server.stop()
        raise RuntimeError(f"etcd did not start:\n{last_error}")

    def _request(self, path: str, body: dict | None = None, timeout: float = 2.0) -> dict:
        import ssl

        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data)
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read() or b"{}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if self._request("/health").get("health") == "true":
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return False

    def _enable_auth(self, password: str) -> None:
        self._request("/v3/auth/user/add", {"name": "root", "password": password})
        self._request("/v3/auth/user/grant", {"user": "root", "role": "root"})
        self._request("/v3/auth/enable", {})
        self.user, self.password = "root", password

    def kill(self) -> None:
        """SIGKILL the server (a crash): its data dir stays for ``restart``."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Start the server again on the same port and data dir; wait until it is healthy.

        Call it from a thread that outlives the server: PR_SET_PDEATHSIG signals the child
        when the *thread* that started it ends.
        """
        assert self.proc.poll() is not None, "the server is still running"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        if not self._wait_ready():
            raise RuntimeError(f"etcd did not restart:\n"
                               f"{self.log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def serves_v2(self) -> bool:
        try:
            self._request("/v2/keys/")
            return True
        except urllib.error.HTTPError:
            return False
