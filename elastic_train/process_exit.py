"""Ending a finished process quickly."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
from typing import NoReturn

_left_in_c: list[threading.Thread] = []
_noting = threading.Lock()


def left_in_c(thread: threading.Thread) -> None:
    """Note a daemon thread that may be left waiting inside a C++ call that may never
    return (a torch store client waiting on a silent peer: live/peers.bounded); those
    that ended since are dropped."""
    with _noting:
        _left_in_c[:] = [t for t in _left_in_c if t.is_alive()]
        _left_in_c.append(thread)


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``, skipping the cycle collector's passes at interpreter shutdown.

    Those passes walk every object torch created, about 1 s for a worker that trained
    (measured on this project's CI machine). Freezing the heap first makes them skip it;
    atexit handlers, thread joins and stream flushes still run as usual.

    A thread still inside a C++ call at interpreter shutdown aborts the process
    ("terminate called without an active exception"): then the process ends with
    ``os._exit(code)`` once its logs and streams are flushed.
    """
    gc.freeze()
    if any(t.is_alive() for t in _left_in_c):
        exit_now(code)
    sys.exit(code)


def exit_command(code: int) -> NoReturn:
    """End an ``elastic-train`` command with ``code``: its threads that are not daemons are
    joined, its atexit handlers run, its logs and streams are flushed, as at any exit; then
    the process ends without the interpreter's teardown.

    In that teardown, a daemon thread coming back from a C++ call (torch's rendezvous
    keep-alive, a store's wait) is ended by the interpreter inside C++ frames, and the
    process aborts ("terminate called without an active exception", exit -6 instead of its
    own code): the fault campaign, c10d seed 652, an agent's exit on the final SIGTERM,
    after its last line. Nothing of the command's waits for the teardown (its files are
    written line by line and closed)."""
    gc.freeze()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the process now with ``code``, from any thread, once its logs and streams are
    flushed: for a process whose main thread may never come back from a C++ call."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
