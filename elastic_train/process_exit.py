"""Ending a finished process quickly."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``, skipping the cycle collector's passes at interpreter shutdown.

    Those passes walk every object torch created, about 1 s for a worker that trained
    (measured on this project's CI machine). Freezing the heap first makes them skip it;
    atexit handlers, thread joins and stream flushes still run as usual.
    """
    gc.freeze()
    sys.exit(code)
