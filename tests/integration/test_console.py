"""Rank 0's console: a live progress line when the worker's stdout is a terminal (a real
pseudo-terminal here), plain periodic lines when it is not (the other tests' log files)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import harness

pytestmark = pytest.mark.slow


def read_until_closed(fd: int, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Everything written to a pseudo-terminal until its last writer exits."""
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:          # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        raise AssertionError(f"no end within {timeout}s: {b''.join(chunks)[-2000:]!r}")
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_one_live_line(tmp_path: Path) -> None:
    reader, writer = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_train.train", "--run-dir", str(tmp_path / "run"),
             "--preset", "tiny", "--steps", "40", "--checkpoint-every", "20",
             "--metrics-port", "0"],
            stdout=writer, stderr=subprocess.DEVNULL, env=harness.job_env())
        os.close(writer)
        shown = read_until_closed(reader, proc, timeout=120)
    finally:
        os.close(reader)
    assert proc.wait(timeout=30) == 0, shown
    lines = shown.split("\r\n")
    live = next(line for line in lines if "\x1b[K" in line)
    draws = [d for d in live.split("\r") if d]
    # Redrawn in place (not one line per step), ending with the last step and its ETA.
    assert 1 <= len(draws) <= 40
    assert all(re.fullmatch(r"step \d+/40  loss [\d.]+ \(mean\)  lr \S+  world 1  "
                            r"(\d+ samples/s  eta \d+:\d\d)?\x1b\[K", d) for d in draws), draws
    assert draws[-1].startswith("step 40/40") and "eta 0:00" in draws[-1]
    assert lines[0].startswith("starting gpt from scratch")
    assert "run local: 40/40 steps" in lines
    assert not [line for line in lines if re.match(r"step \d+/40 ", line)]  # no plain lines


def test_a_finished_run_directory_says_so(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "elastic_train.train", "--run-dir", str(tmp_path / "run"),
            "--preset", "tiny", "--steps", "4", "--checkpoint-every", "2", "--metrics-port", "0"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           env=harness.job_env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert "is finished" not in first.stdout
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           env=harness.job_env())
    assert again.returncode == 0, again.stdout + again.stderr
    assert (f"{tmp_path / 'run'} is finished: its newest checkpoint is at step 4 of --steps 4; "
            "nothing to train (raise --steps to train on, or use a new --run-dir to start "
            "afresh)") in again.stdout.splitlines()
