"""Noticing a worker's death the moment it happens (Linux pidfds), not at the next poll.

torch's agent polls its workers every ``--monitor-interval`` (0.1 s by default). Under live
recovery a worker that died is started again by its agent, and until then the survivors
wait: a poll that comes up to 0.1 s late is a large share of a recovery that takes 0.2 s.
``ExitWatch`` holds a pidfd per worker and sets an event when one becomes readable (its
process ended), which wakes the agent's monitor loop at once. Where pidfds are missing
(not Linux, a kernel before 5.3) it watches nothing and the poll finds the death as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Iterable
from typing import Any


class ExitWatch:
    """Set ``wake`` when any watched process ends."""

    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._ended: dict[int, float] = {}  # pid -> when its end was seen
        self._stopped = False
        self._signal_r, self._signal_w = os.pipe()  # wakes the poll: a new pid, or stop
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        return hasattr(os, "pidfd_open") and hasattr(select, "poll")

    def watch(self, pid: int) -> None:
        """Watch ``pid`` from now on (one that already ended sets ``wake`` at once)."""
        if not self.available():
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._wake.set()
            return
        except OSError:  # no pidfds here (ENOSYS): the agent's poll still finds it
            return
        with self._lock:
            if self._stopped:
                os.close(fd)
                return
            self._fds[fd] = pid
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="worker-exit-watch",
                                                daemon=True)
                self._thread.start()
            os.write(self._signal_w, b"w")

    def _run(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self._signal_r, select.POLLIN)
            with self._lock:
                if self._stopped:
                    return
                for fd in self._fds:
                    poller.register(fd, select.POLLIN)
            ended = False
            for fd, _ in poller.poll():
                if fd == self._signal_r:
                    os.read(self._signal_r, 4096)
                    continue
                with self._lock:
                    pid = self._fds.pop(fd, None)
                    if pid is not None:
                        os.close(fd)
                        self._ended[pid] = time.monotonic()
                        ended = True
            if ended:
                self._wake.set()

    def watch_started(self, pids: dict[int, Any]) -> dict[int, Any]:
        """``pids`` (torch's started workers), each watched for its end from now on."""
        for pid in pids.values():
            if isinstance(pid, int):
                self.watch(pid)
        return pids

    def wake_if_unreported(self, pids: Iterable[Any]) -> None:
        """A watched worker among ``pids`` ended but its process context does not report
        it yet (a forkserver reaps and reports its children a moment later): set ``wake``
        to look again soon, not at the next --monitor-interval."""
        if self.ended_among(pids):
            time.sleep(0.001)
            self._wake.set()

    def ended_among(self, pids: Iterable[int], within: float = 0.25) -> bool:
        """Whether one of ``pids`` ended in the last ``within`` seconds (its parent may not
        have reported it yet: a forkserver reaps and reports its children a moment later)."""
        now = time.monotonic()
        with self._lock:
            self._ended = {p: t for p, t in self._ended.items() if now - t < within}
            return any(p in self._ended for p in pids)

    def close(self) -> None:
        """Stop watching; release every pidfd."""
        with self._lock:
            self._stopped = True
            fds, self._fds = list(self._fds), {}
        os.write(self._signal_w, b"s")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in (self._signal_r, self._signal_w):
            with contextlib.suppress(OSError):
                os.close(fd)
