"""Every external program the tests run, found where the README's install puts it.

Two kinds, two places:

- **installed with the project** (``pip install -e '.[dev]'`` into the venv: hadolint,
  ruff, moto_server, ...): looked up in this interpreter's own scripts directory, never on
  ``PATH``. A new user's ``make test`` runs ``.venv/bin/python -m pytest`` without the venv
  on ``PATH``; a lookup on ``PATH`` would pass only on machines where someone installed the
  tool by hand.
- **system services** (etcd, Prometheus, promtool, openssl): installed by
  ``scripts/install-test-deps.sh`` with the system's package manager, so on ``PATH``.

A missing tool skips the test, except under ``CI=true``, where it fails: CI must run them.
``tests/conftest.py`` shadows the first kind on ``PATH`` (see ``shadow_installed_tools``),
so a test that looks one up there fails on every machine, not only on a new user's.
"""

from __future__ import annotations

import os
import shutil
import stat
import sysconfig
from pathlib import Path

import pytest

INSTALLED_TOOLS = ("hadolint", "ruff", "kubernetes-validate", "elastic-train", "torchrun",
                   "moto_server")
"""Programs that ``pip install -e '.[dev]'`` puts in the venv's scripts directory."""

SYSTEM_TOOLS = ("etcd", "prometheus", "promtool", "openssl", "kubectl", "kustomize", "ip",
                "unshare", "iptables", "tc")
"""Programs that scripts/install-test-deps.sh (or the system) puts on ``PATH``; kubectl and
kustomize are optional (a comparison that runs when they are there); ip, unshare,
iptables and tc make the network-namespace test bed (tests/netbed.py)."""

SHADOW_EXIT = 97
SHADOW_MESSAGE = ("{name} was looked up on PATH by a test: programs installed with the "
                  "project live in the venv, use tests.tools.installed_tool({name!r})")


def scripts_dir() -> Path:
    """Where pip put this interpreter's console scripts and binary wheels' programs."""
    return Path(sysconfig.get_path("scripts"))


def missing(message: str) -> None:
    """Skip the calling test because something it needs is missing; fail under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)




def installed_tool(name: str) -> str:
    """The path of a program installed with the project (see the module docstring)."""
    assert name in INSTALLED_TOOLS, f"{name}: add it to INSTALLED_TOOLS"
    path = scripts_dir() / name
    if not os.access(path, os.X_OK):
        missing(f"{name} is not installed in {scripts_dir()}: run make setup "
                 "(pip install -e '.[dev]')")
    return str(path)


def system_tool(name: str, message: str) -> str:
    """The path of a system program (see the module docstring); ``message`` says how to get
    it when it is missing."""
    assert name in SYSTEM_TOOLS, f"{name}: add it to SYSTEM_TOOLS"
    path = shutil.which(name)
    if path is None:
        missing(message)
    return str(path)


def system_tool_available(name: str) -> bool:
    assert name in SYSTEM_TOOLS, f"{name}: add it to SYSTEM_TOOLS"
    return shutil.which(name) is not None


def shadow_installed_tools(directory: Path) -> str:
    """Fill ``directory`` with stand-ins for INSTALLED_TOOLS that fail loudly, and return a
    ``PATH`` that puts it first: a test (or a program it starts) that finds one of them on
    ``PATH`` fails with SHADOW_MESSAGE on every machine."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in INSTALLED_TOOLS:
        stand_in = directory / name
        message = SHADOW_MESSAGE.format(name=name).replace("'", "'\\''")
        stand_in.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit {SHADOW_EXIT}\n")
        stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return os.pathsep.join([str(directory), os.environ.get("PATH", os.defpath)])
