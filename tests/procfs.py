"""What the tests read of processes from /proc: state, parent, children, name. One parser
of ``/proc/PID/stat`` (its second field, the name, may hold spaces and parentheses: the
fields after it are read from the last ``)``)."""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the name (state first, then the parent's
    pid, ...); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str:
    """The state letter (R, S, D, T, t, Z, ...); ``""`` when the process is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def alive(pid: int) -> bool:
    """Running or stopped: not gone and not a zombie (dead, its parent not reaped it yet)."""
    return state(pid) not in ("", "Z", "X")


def parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def children(pid: int) -> list[int]:
    return [child for child in pids() if parent(child) == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children before grandchildren."""
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def name(pid: int) -> str:
    """The process's name (``/proc/PID/comm``: what ``prctl``/``setproctitle`` set); ``""``
    when it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
