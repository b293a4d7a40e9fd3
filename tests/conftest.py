"""Shared fixtures: real etcd servers, started once per session when a test asks for one;
and the guard that keeps tests from finding the venv's programs on PATH (tests/tools.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tools
from tests.etcd_server import EtcdServer

_SHADOW_DIR: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Put failing stand-ins for the venv's programs first on PATH for the whole run."""
    global _SHADOW_DIR
    _SHADOW_DIR = Path(tempfile.mkdtemp(prefix="elastic-train-shadow-"))
    os.environ["PATH"] = tools.shadow_installed_tools(_SHADOW_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SHADOW_DIR is not None:
        shutil.rmtree(_SHADOW_DIR, ignore_errors=True)


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
