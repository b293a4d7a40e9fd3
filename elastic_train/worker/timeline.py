"""Wall-clock marks of a worker's start-up, for recovery measurements."""

from __future__ import annotations

import os
import time


def process_start_time() -> float | None:
    """When this process started (epoch seconds), from /proc; None where /proc is absent."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat: start time in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Relative to uptime (10 ms resolution), not /proc/stat's btime (whole seconds).
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
