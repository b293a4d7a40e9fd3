"""What ends the live agent's wait between two checks of its workers at once.

torch's monitor loop sleeps --monitor-interval before each check; the live agent waits on a
``Wakeup`` instead, which a peer's call or a worker's report (a push to ``WAKE_KEY`` in the
agent's own store, read by a thread of its own), a worker's death (agent/exit_watch.py) or
the failure detector's suspicion (agent/failure_detector.py) sets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from datetime import timedelta

import torch.distributed as dist

from elastic_train.live.peers import WAKE_KEY

log = logging.getLogger(__name__)

STOP = b"stop"


class Wakeup:
    """An event the agent's loop waits on, and the thread that sets it on ``WAKE_KEY``."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self) -> None:
        self.event.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; whether something woke the loop (then cleared: what woke
        it is read by the caller, and a later push wakes it again)."""
        woken = self.event.wait(seconds)
        if woken:
            self.event.clear()
        return woken

    def watching(self) -> bool:
        """Whether pushes to ``WAKE_KEY`` wake the loop (else it looks at every check)."""
        return self._thread is not None and self._thread.is_alive()

    def watch(self, store: dist.TCPStore, host: str) -> None:
        """Wake on every push to ``WAKE_KEY`` in ``store`` (its own client, at ``host``:
        where the store listens); nothing on a torch without store queues (before 2.6)."""
        if not hasattr(store, "queue_pop"):
            return
        self._thread = threading.Thread(target=self._wait_for_calls, args=(host, store.port),
                                        name="live-agent-wake", daemon=True)
        self._thread.start()

    def close(self, store: dist.Store | None) -> None:
        """End the thread, while ``store`` still runs: a thread left blocked in the store's
        client would end inside C++ when the interpreter finalizes."""
        if self._thread is not None and store is not None:
            with contextlib.suppress(RuntimeError, OSError):
                store.queue_push(WAKE_KEY, STOP)
            self._thread.join(timeout=5)
            self._thread = None

    def _wait_for_calls(self, host: str, port: int) -> None:
        """Wake the monitor loop whenever something is pushed to ``WAKE_KEY``. Should this
        thread end early (it cannot reach the store), the loop looks at every check."""
        try:
            client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(days=7))
        except (RuntimeError, OSError) as exc:
            log.warning("the agent cannot watch its own store at %s:%d (%s): it looks for "
                        "calls every --monitor-interval instead", host, port, exc)
            return
        while True:
            try:
                item = client.queue_pop(WAKE_KEY, block=True)
            except (RuntimeError, OSError):
                return
            if item == STOP:
                return
            self.event.set()
