"""Lowering one thread's CPU priority: the checkpoint writer's (checkpoint/persister.py)
and the memory tier's copies (agent/snapshot_holder.py) run only when training does not
want the core. Torch-free: the launcher imports it before its workers' server starts.
"""

from __future__ import annotations

import os
import threading

# The writer thread runs in Linux's SCHED_IDLE class: it gets a core only when no training
# thread of this or any other worker wants it (the waits in collectives, a spare core),
# so the write takes no CPU from training. Where that class is not available, niceness 10.
# The snapshot training waited for is already taken; at shutdown training waits anyway.
WRITER_NICENESS = 10


def lower_thread_priority() -> None:
    """Lower this thread's CPU priority (Linux: per thread); elsewhere nothing."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICENESS)
    except (AttributeError, OSError):
        pass
