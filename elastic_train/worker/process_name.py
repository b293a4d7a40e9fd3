"""A worker's name in ps and top: which rank a process is, at a glance."""

from __future__ import annotations

__all__ = ["name_process"]


def name_process(rank: int | None) -> None:
    """Show a worker's rank in ps/top (``et-rank-N``; a hot spare's ``et-spare``); Linux
    only, silently skipped elsewhere. (A forked worker's environment in /proc is its
    server's: the name is what tells the workers apart.)"""
    name = "et-spare" if rank is None else f"et-rank-{rank}"
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
