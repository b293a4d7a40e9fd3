"""How a command's process ends (elastic_train/process_exit.py): with its own code, its
atexit handlers run, and never an abort in the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

STORE_CALL_BACK_IN_TEARDOWN = """
import os, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from elastic_train.process_exit import exit_command
server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                       wait_for_workers=False)
waiter = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
def wait_a_little():  # a daemon thread in a C++ store call that returns 0.4 s from now
    try:
        waiter.wait(["never"], timedelta(seconds=0.4))
    except Exception:
        pass
class SlowTeardown:  # the interpreter's teardown of sys lasts 1 s: the call returns in it
    def __init__(self, sleep, write):
        self.sleep, self.write = sleep, write
    def __del__(self):
        self.write(2, b"teardown\\n")
        self.sleep(1.0)
sys.slow_teardown = SlowTeardown(time.sleep, os.write)
threading.Thread(target=wait_a_little, daemon=True).start()
{end}(7)
"""


def ended(end: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", STORE_CALL_BACK_IN_TEARDOWN.format(end=end)],
                          capture_output=True, text=True, timeout=60)


def test_a_daemon_thread_back_from_a_store_call_at_exit_never_aborts_a_command() -> None:
    """The fault campaign, c10d seed 652: an agent ended on the final SIGTERM with -6
    ("terminate called without an active exception") after its last line: a daemon
    thread came back from a C++ store call during the interpreter's teardown, and the
    interpreter ended that thread inside C++ frames. A command now ends before that
    teardown, with its own code."""
    through_teardown = ended("sys.exit")  # an exit through the interpreter's teardown
    assert through_teardown.returncode == -6, through_teardown.stderr[-2000:]
    assert "terminate called without an active exception" in through_teardown.stderr
    command = ended("exit_command")
    assert command.returncode == 7, command.stderr[-2000:]
    assert "terminate called" not in command.stderr and "teardown" not in command.stderr


JOINS_AND_HANDLERS = """
import atexit, threading, time
from elastic_train.process_exit import exit_command
atexit.register(lambda: print("atexit handler ran", flush=True))
def last_words():
    time.sleep(0.3)
    print("non-daemon thread finished", flush=True)
threading.Thread(target=last_words).start()
print("exiting", flush=True)
exit_command(5)
"""


def test_a_command_ends_after_its_threads_and_atexit_handlers_with_its_code() -> None:
    done = subprocess.run([sys.executable, "-c", JOINS_AND_HANDLERS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert done.stdout.splitlines() == ["exiting", "non-daemon thread finished",
                                        "atexit handler ran"]
