"""Shared fixtures: real etcd servers and an S3 endpoint (moto's server), started once per
session when a test asks for one; the multi-host test bed (tests/netbed.py); the guard
that keeps tests from finding the venv's programs on PATH (tests/tools.py); and a hard
limit per test that ends the run even when a hang holds the GIL."""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from elastic_train.torch_compat import CACHE_DIR
from tests import netbed as netbed_module
from tests import tools
from tests.etcd_server import EtcdServer
from tests.s3_server import S3Server

_SHADOW_DIR: Path | None = None
_VERDICTS_DIR: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Put failing stand-ins for the venv's programs first on PATH for the whole run; the
    torch check's remembered verdicts (torch_compat.Verdicts) in a directory of the run's
    own, not the user's cache."""
    global _SHADOW_DIR, _VERDICTS_DIR
    _SHADOW_DIR = Path(tempfile.mkdtemp(prefix="elastic-train-shadow-"))
    os.environ["PATH"] = tools.shadow_installed_tools(_SHADOW_DIR)
    _VERDICTS_DIR = Path(tempfile.mkdtemp(prefix="elastic-train-verdicts-"))
    os.environ[CACHE_DIR] = str(_VERDICTS_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    for made in (_SHADOW_DIR, _VERDICTS_DIR):
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


HARD_LIMIT_MARGIN = 120.0
"""Seconds past a test's own timeout (pytest-timeout's, 300 s by default) after which the
whole run ends: pytest-timeout's thread needs the GIL, and a hang in C code that holds it
(twice in tests/unit on 2026-11-28, 15 minutes without a line, not reproduced in 5 runs
since) starved it, so that CI would have waited its 90 minutes. faulthandler's watchdog is
C: it prints every thread's stack and exits the process (code 1)."""
HARD_LIMIT = "ELASTIC_TRAIN_TEST_HARD_LIMIT"
"""Seconds, overriding the limit (for the test of the limit itself)."""


def hard_limit(item: pytest.Item) -> float:
    """When ``item``'s run is ended: its timeout plus ``HARD_LIMIT_MARGIN``."""
    if os.environ.get(HARD_LIMIT):
        return float(os.environ[HARD_LIMIT])
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker is not None and marker.args else \
        float(item.config.getini("timeout") or 0) or 300.0
    return float(timeout) + HARD_LIMIT_MARGIN


_STDERR_COPY: int | None = None
"""The run's own stderr, copied before any test captures fd 2: the stacks go there."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _STDERR_COPY
    if _STDERR_COPY is None:
        _STDERR_COPY = os.dup(sys.__stderr__.fileno())
    limit = hard_limit(item)
    faulthandler.dump_traceback_later(limit, exit=True, file=_STDERR_COPY)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def etcd_v3() -> Iterator[EtcdServer]:
    """An etcd serving only the v3 API (like etcd 3.6, which removed v2)."""
    server = EtcdServer.start(v2=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_v2() -> Iterator[EtcdServer]:
    """An etcd started with --enable-v2, for torch's own etcd and etcd-v2 backends."""
    server = EtcdServer.start(v2=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port, shared by the session (its buckets too: take
    ``s3_bucket``). A test that freezes or stops a server starts its own (S3Server.start)."""
    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> tuple[S3Server, str]:
    """(the session's S3 server, the name of a bucket made for this test alone)."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.make_bucket(name)
    return s3_server, name


@pytest.fixture
def netbed(tmp_path: Path) -> Iterator[Callable[..., netbed_module.Netbed]]:
    """A factory of multi-host test beds (``Netbed.create``'s arguments; logs and etcd's data
    under the test's tmp_path): every bed it made is torn down after the test, failed or
    not. Skips where namespaces cannot be made (fails under CI=true)."""
    beds: list[netbed_module.Netbed] = []

    def make(names: Sequence[str] = ("node-a", "node-b"), etcd: bool = False,
             loopback_name: bool = False) -> netbed_module.Netbed:
        netbed_module.require()
        bed = netbed_module.Netbed.create(names, etcd=etcd, loopback_name=loopback_name,
                                          workdir=tmp_path / f"netbed-{len(beds)}")
        beds.append(bed)
        return bed

    yield make
    errors = []
    for bed in reversed(beds):
        try:
            bed.close()
        except netbed_module.NetbedError as error:
            errors.append(error)
    assert not errors, errors
