"""A poll with a deadline, for conditions that no event announces (a process's state in
/proc, a key in a store another process writes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               every: float = 0.02) -> float:
    """Poll ``condition`` until it holds; the seconds it took. Fails naming ``what`` once
    ``timeout`` seconds have passed without it."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(every)
    return time.monotonic() - began
