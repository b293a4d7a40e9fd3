"""Shared fixtures: real etcd servers, started once per session when a test asks for one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.etcd_server import EtcdServer


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
