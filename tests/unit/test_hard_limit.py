"""The hard limit per test (tests/conftest.py): a test that hangs holding the GIL, where
pytest-timeout's thread cannot run, ends the whole run with every thread's stack and a
non-zero exit, instead of a CI job that waits out its 90 minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HANGS = '''
import re


def test_hangs_holding_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: the GIL, for ages
'''


def test_a_test_that_hangs_holding_the_gil_ends_the_run_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    env = {**os.environ, "ELASTIC_TRAIN_TEST_HARD_LIMIT": "3"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", str(tmp_path / "test_hangs.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-2000:]
    assert took < 60, took
    assert "Timeout (0:00:03)!" in output, output[-2000:]
    assert "in test_hangs_holding_the_gil" in output, output[-2000:]
