"""tests/procfs.py against real processes: a stopped one, a zombie, a grandchild, a name with
spaces and parentheses (which a naive split of /proc/PID/stat misreads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests import procfs
from tests.polling import wait_until

NAMED = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'a (b) c', 0, 0, 0); "
         "print('ready', flush=True); time.sleep(60)")


def test_state_parent_and_a_name_with_spaces_and_parentheses() -> None:
    child = subprocess.Popen([sys.executable, "-c", NAMED], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert procfs.name(child.pid) == "a (b) c"
        assert procfs.parent(child.pid) == os.getpid()
        assert procfs.state(child.pid) in ("S", "R") and procfs.alive(child.pid)
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: procfs.state(child.pid) == "T", 10, "stopped")
        assert procfs.alive(child.pid)           # stopped is alive
        child.kill()
        wait_until(lambda: procfs.state(child.pid) == "Z", 10, "a zombie")
        assert not procfs.alive(child.pid)       # a zombie is not
    finally:
        child.kill()
        child.wait()
    assert procfs.state(child.pid) == "" and procfs.parent(child.pid) is None
    assert procfs.name(child.pid) == ""


def test_descendants_reach_grandchildren() -> None:
    inner = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
            "'import time; time.sleep(60)']); print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", inner], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        found = procfs.descendants(os.getpid())
        assert child.pid in found
        grandchildren = procfs.children(child.pid)
        assert len(grandchildren) == 1 and grandchildren[0] in found
        assert found.index(child.pid) < found.index(grandchildren[0])
    finally:
        for pid in procfs.descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
