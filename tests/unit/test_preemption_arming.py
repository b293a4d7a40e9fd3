"""A SIGTERM before a worker holds the training state ends it at once (exit 143): it has
nothing to checkpoint and may wait where no step boundary comes; after, it is a flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = """
import signal, sys, time
from elastic_train.worker.preemption import StopRequest
stop = StopRequest(30.0).install()
if sys.argv[1] == "armed":
    stop.arm()
print("ready", flush=True)
deadline = time.monotonic() + 20
while not stop.requested and time.monotonic() < deadline:
    time.sleep(0.01)
print("flag" if stop.requested else "timeout", flush=True)
"""


def _signalled(mode: str) -> tuple[int, str, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err, time.monotonic() - sent


def test_before_the_state_is_held_sigterm_exits_at_once() -> None:
    code, out, err, seconds = _signalled("unarmed")
    assert code == 143 and out == "" and seconds < 5
    assert err == ("elastic_train: SIGTERM before this worker held the training state: "
                   "exiting now (nothing to checkpoint; the newest checkpoint stands)\n")


def test_once_the_state_is_held_sigterm_is_a_stop_request() -> None:
    code, out, err, _ = _signalled("armed")
    assert (code, out, err) == (0, "flag\n", "")
