"""A rendezvous that cannot work fails before any worker starts, with one line that says why.

Real etcd servers: one without the v2 API (what etcd 3.6 is), one serving https with
client certificates, one with user authentication. ``elastic-train run`` is called in
this process (its pre-flight fails before torch's agent starts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_train.agent import launch
from elastic_train.errors import RendezvousUnavailableError
from elastic_train.rendezvous.etcd_v3.create import connect
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.preflight import check_rendezvous
from tests.etcd_server import EtcdServer, TlsFiles, free_port


def run_line(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``elastic-train run ARGV``: its exit code and its one line on stderr."""
    code = launch.main(["--nnodes", "1:2", "--rdzv-id", "job", "--steps", "5", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("elastic-train: error: ")
    return code, lines[0].removeprefix("elastic-train: error: ")


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_torchs_v2_backends_on_an_etcd_without_v2(backend: str, etcd_v3: EtcdServer,
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_line(capsys, "--rdzv-backend", backend, "--rdzv-endpoint",
                          etcd_v3.endpoint, "--run-dir", str(tmp_path / "run"))
    assert code == 1
    assert line == (f"etcd at http://{etcd_v3.endpoint} does not serve the v2 API that "
                    f"--rdzv-backend {backend} needs (etcd 3.6 removed it; 3.4 and 3.5 serve "
                    "it only with --enable-v2): use --rdzv-backend etcd-v3, which needs only "
                    "the v3 API")
    assert not (tmp_path / "run").exists()  # nothing was started


def test_the_v2_check_passes_where_v2_is_served(etcd_v2: EtcdServer) -> None:
    check_rendezvous("etcd", etcd_v2.endpoint, {})
    check_rendezvous("etcd-v2", etcd_v2.endpoint, {})
    check_rendezvous("etcd-v3", etcd_v2.endpoint, {})  # 3.4 serves v3 either way


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_no_etcd_there(backend: str, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    """torch's v2 backends get the same bounded wait for an etcd that is still starting."""
    port = free_port()
    began = time.monotonic()
    code, line = run_line(capsys, "--rdzv-backend", backend, "--rdzv-endpoint",
                          f"127.0.0.1:{port}", "--rdzv-conf", "connect_timeout=1",
                          "--run-dir", str(tmp_path / "run"))
    assert code == 1
    assert 1 <= time.monotonic() - began < 10
    assert line.startswith(f"cannot reach etcd at http://127.0.0.1:{port} for 1 s (")
    assert "Connection refused" in line
    assert line.endswith("): check that etcd runs there and --rdzv-endpoint, or wait longer "
                         "with --rdzv-conf connect_timeout=SECONDS")


def test_no_etcd_there_for_etcd_v3_is_retried_for_connect_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """etcd-v3 retries an etcd that does not answer (it may be starting), for a bounded
    time, then fails with one line naming the endpoint, how long, and both fixes."""
    port = free_port()
    began = time.monotonic()
    code, line = run_line(capsys, "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                          f"127.0.0.1:{port}", "--rdzv-conf", "connect_timeout=2", "--run-dir",
                          str(tmp_path / "run"))
    elapsed = time.monotonic() - began
    assert code == 1
    assert line == (f"cannot reach etcd at http://127.0.0.1:{port} for 2 s (reading its "
                    "version: [Errno 111] Connection refused): check that etcd runs there and "
                    "--rdzv-endpoint, or wait longer with --rdzv-conf connect_timeout=SECONDS")
    assert 2 <= elapsed < 10, elapsed
    assert not (tmp_path / "run").exists()  # nothing was started


def test_an_etcd_that_comes_up_during_the_retries_is_used(tmp_path: Path) -> None:
    """The pre-flight waits for an etcd that starts a moment after the job."""
    server = EtcdServer.start()
    server.kill()
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            check_rendezvous("etcd-v3", server.endpoint, {"connect_timeout": "30"})
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    checking = threading.Thread(target=check)
    checking.start()  # etcd is down: it retries
    try:
        server.restart()  # in this thread: the server dies with the thread that started it
        checking.join(timeout=60)
    finally:
        server.stop()
    assert outcome == [None]


@pytest.mark.parametrize(("conf", "expected"), [
    ("last_cal_timeout=3", "unknown --rdzv-conf key 'last_cal_timeout' for etcd-v3 (did you "
                           "mean 'last_call_timeout'?); known: key_prefix, protocol, "),
    ("join_timeout=soon", "--rdzv-conf join_timeout=soon is invalid: expected a number of "
                          "seconds"),
    ("design=state-key,keep_alive_interval=1,keep_alive_max_attempt=3",
     "--rdzv-conf keep_alive_interval=1 with keep_alive_max_attempt=3 declares a node dead "
     "after 3 s, but a live node's heartbeat can be 5 s old: use keep_alive_max_attempt=5 "
     "or more"),
    ("keep_alive_interval=1", "--rdzv-conf keep_alive_interval does not apply to the etcd-v3 "
                              "rendezvous, which notices a dead node when its lease expires: "
                              "set lease_ttl=SECONDS (default 10) instead"),
    ("ssl_cert=/nonexistent.pem,ssl_cert_key=/x.key",
     "--rdzv-conf ssl_cert=/nonexistent.pem: no such file"),
    ("ca_cert=/nonexistent/ca.pem", "--rdzv-conf ca_cert=/nonexistent/ca.pem: no such file"),
    ("connect_timeout=-3", "--rdzv-conf connect_timeout=-3 is invalid: it must be positive"),
    ("password=secret", "--rdzv-conf has a password but no user: add user=NAME"),
    ("key_prefix=relative", "--rdzv-conf key_prefix=relative is invalid: use an absolute key "
                            "like /jobs/rendezvous"),
])
def test_bad_etcd_v3_options(conf: str, expected: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_line(capsys, "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                          "127.0.0.1:2379", "--rdzv-conf", conf, "--run-dir",
                          str(tmp_path / "run"))
    assert code == 2
    assert line.startswith(expected), line


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("127.0.0.1:23x9", "--rdzv-endpoint 127.0.0.1:23x9 has an invalid port '23x9': write "
                       "HOST:PORT"),
    ("10.0.0.1:2379,10.0.0.2:2379", "--rdzv-endpoint 10.0.0.1:2379,10.0.0.2:2379 is invalid: "
                                    "give one etcd member as HOST:PORT"),
    ("etcd://h:2379", "protocol 'etcd' is invalid: use http or https"),
])
def test_malformed_etcd_endpoint(endpoint: str, expected: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_line(capsys, "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint,
                          "--run-dir", str(tmp_path / "run"))
    assert (code, line) == (2, expected)
    assert not (tmp_path / "run").exists()  # nothing was started


def test_etcd_v3_needs_an_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_line(capsys, "--nnodes", "1", "--rdzv-backend", "etcd-v3", "--run-dir",
                          str(tmp_path / "run"))
    assert (code, line) == (2, "--rdzv-backend etcd-v3 needs --rdzv-endpoint HOST:PORT of an "
                               "etcd server")


def test_heartbeat_settings_of_torchs_backends_are_checked_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_line(capsys, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          "127.0.0.1:29400", "--rdzv-conf", "keep_alive_interval=1",
                          "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert "keep_alive_max_attempt=3 declares a node dead after 3 s" in line


# ---- TLS and authentication against real etcd servers ------------------------------------


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer.start(tls=TlsFiles.create(tmp_path_factory.mktemp("tls")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer.start(auth_password="s3cret")
    yield server
    server.stop()


def test_tls_with_a_client_certificate(tls_etcd: EtcdServer) -> None:
    tls = tls_etcd.tls
    assert tls is not None
    conf = {"ca_cert": str(tls.ca), "ssl_cert": str(tls.client_cert),
            "ssl_cert_key": str(tls.client_key)}
    options = EtcdV3Options.parse(tls_etcd.endpoint, conf)
    assert options.endpoint.protocol == "https"  # implied by ca_cert
    kv = connect(options)
    assert kv.version().startswith("3.")
    kv.put("/tls/key", b"value")
    assert kv.get("/tls/key").value == b"value"
    check_rendezvous("etcd-v3", tls_etcd.endpoint, conf)


def test_tls_without_the_client_certificate_names_the_tls_options(tls_etcd: EtcdServer
                                                                  ) -> None:
    tls = tls_etcd.tls
    assert tls is not None
    kv = connect(EtcdV3Options.parse(tls_etcd.endpoint, {"ca_cert": str(tls.ca)}))
    with pytest.raises(RendezvousConnectionError) as info:
        kv.get("/tls/key")
    message = str(info.value)
    assert message.startswith(f"cannot reach etcd at https://{tls_etcd.endpoint} (reading "
                              "/tls/key: ")
    assert message.endswith("check the TLS options ca_cert, ssl_cert, ssl_cert_key in "
                            "--rdzv-conf")
    plain = connect(EtcdV3Options.parse(tls_etcd.endpoint, {}))  # http to an https server
    with pytest.raises(RendezvousConnectionError, match="cannot reach etcd at http://"):
        plain.version()


def test_user_and_password(auth_etcd: EtcdServer, tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("s3cret\n")
    conf = {"user": "root", "password_file": str(password_file)}
    kv = connect(EtcdV3Options.parse(auth_etcd.endpoint, conf))
    kv.put("/auth/key", b"1")
    assert kv.get("/auth/key").value == b"1"
    # An expired token is replaced by logging in again, once.
    kv._client.session.headers["Authorization"] = "expired.token"
    assert kv.get("/auth/key").value == b"1"
    check_rendezvous("etcd-v3", auth_etcd.endpoint, conf)


def test_wrong_or_missing_credentials(auth_etcd: EtcdServer) -> None:
    wrong = {"user": "root", "password": "guess"}
    with pytest.raises(RendezvousUnavailableError) as info:
        check_rendezvous("etcd-v3", auth_etcd.endpoint, wrong)
    assert str(info.value) == (
        f"etcd at http://{auth_etcd.endpoint} refused logging in as root (etcdserver: "
        "authentication failed, invalid user ID or password): check user and password in "
        "--rdzv-conf and the user's permissions on the key prefix")
    anonymous = connect(EtcdV3Options.parse(auth_etcd.endpoint, {}))
    with pytest.raises(RendezvousConnectionError, match="etcdserver: user name is empty"):
        anonymous.get("/auth/key")
