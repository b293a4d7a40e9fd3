"""Persist snapshots in the background: one writer thread, at most one persist in flight."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_train.thread_priority import lower_thread_priority

log = logging.getLogger(__name__)

@dataclass
class PersistResult:
    """How the last persist ended."""

    step: int
    seconds: float
    error: BaseException | None = None


class BackgroundPersister:
    """Runs ``persist()`` callables on a worker thread, one at a time.

    ``submit`` returns at once; ``wait`` blocks until the persist in flight (if any) is
    done and returns how it ended. A failure never raises on the writer thread: it is
    kept in the result for the caller to report.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: PersistResult | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, persist: Callable[[], None]) -> None:
        if self.busy:
            raise RuntimeError("a persist is already in flight: wait() for it first")

        def run() -> None:
            lower_thread_priority()
            started = time.monotonic()
            try:
                persist()
                self._result = PersistResult(step, time.monotonic() - started)
            except BaseException as exc:  # reported by the caller
                self._result = PersistResult(step, time.monotonic() - started, exc)

        self._result = None
        self._thread = threading.Thread(target=run, name=f"checkpoint-persist-{step}",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> PersistResult | None:
        """Block until no persist is in flight; the result of the last one (None if none)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        result, self._result = self._result, None
        return result
