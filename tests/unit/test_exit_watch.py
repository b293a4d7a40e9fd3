"""ExitWatch on real processes: a worker's end wakes the agent at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from elastic_train.agent.exit_watch import ExitWatch

pytestmark = pytest.mark.skipif(not ExitWatch.available(), reason="no pidfds here")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_killed_process_wakes_the_watcher_at_once() -> None:
    wake = threading.Event()
    watch = ExitWatch(wake)
    first, second = _sleeper(), _sleeper()
    try:
        watch.watch(first.pid)
        watch.watch(second.pid)
        assert not wake.wait(0.2)  # nothing ended: nothing wakes it
        killed_at = time.monotonic()
        second.kill()
        assert wake.wait(5)
        assert time.monotonic() - killed_at < 1.0
        assert watch.ended_among([second.pid]) and not watch.ended_among([first.pid])
        assert not watch.ended_among([second.pid], within=0.0)  # forgotten after a while
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait(5)
        watch.close()


def test_a_process_already_gone_wakes_it_and_close_stops_watching() -> None:
    wake = threading.Event()
    watch = ExitWatch(wake)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # reaped: no such process any more
    watch.watch(gone.pid)
    assert wake.is_set()
    wake.clear()
    running = _sleeper()
    try:
        watch.watch(running.pid)
        watch.close()
        watch.watch(running.pid)  # after close: ignored, no error
        running.kill()
        running.wait(5)
        assert not wake.wait(0.2)
    finally:
        running.kill()
        running.wait(5)
