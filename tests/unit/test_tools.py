"""The guard of tests/tools.py: programs installed with the project are found in the venv,
and a lookup on PATH fails on every machine (not only on a new user's)."""

from __future__ import annotations

import re
import shutil
import subprocess

from tests import tools
from tests.integration import harness


def test_a_program_installed_with_the_project_is_not_found_on_path() -> None:
    found = shutil.which("hadolint")
    assert found is not None and not found.startswith(str(tools.scripts_dir()))
    done = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10)
    assert done.returncode == tools.SHADOW_EXIT
    assert done.stderr.strip() == ("hadolint was looked up on PATH by a test: programs "
                                   "installed with the project live in the venv, use "
                                   "tests.tools.installed_tool('hadolint')")


def test_every_program_installed_with_the_project_is_in_the_venv() -> None:
    for name in tools.INSTALLED_TOOLS:
        path = tools.installed_tool(name)
        assert path.startswith(str(tools.scripts_dir())), path
        done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{path} --help: {done.stderr[-400:]}"


def test_only_tests_tools_looks_programs_up() -> None:
    offenders = []
    for path in sorted((harness.REPO / "tests").rglob("*.py")):
        if path.name in ("tools.py", "test_tools.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"shutil\.which\(", line):
                offenders.append(f"{path.relative_to(harness.REPO)}:{number}")
    assert offenders == [], "look programs up through tests/tools.py"
