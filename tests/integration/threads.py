"""Run a function in threads, with a bound on the wait: the rendezvous tests' participants."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def run_threads(target: Callable[[int], Any], count: int, timeout: float = 60) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads; return results; re-raise the first error."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    if errors:
        raise errors[0]
    return results
