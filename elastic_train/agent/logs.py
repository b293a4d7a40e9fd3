"""torch's agent log lines about a failed worker, naming the worker's global rank.

torch 2.13's process contexts log ``failed (exitcode: -9) local_rank: 0 (pid: N) ...``: on
a node whose workers are ranks 2 and 3, or after a restart re-numbered them, the local
rank does not say which worker failed. While ``global_ranks_in_logs`` is active the line
reads ``failed (exitcode: -9) rank: 1 (local_rank: 0, pid: N) ...``. The rank comes from
the environment the context gave each worker (``RANK``), recorded when it started them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

TORCH_LOGGER = "torch.distributed.elastic.multiprocessing.api"
LOCAL = " local_rank: %s (pid: %s)"
GLOBAL = " rank: %s (local_rank: %s, pid: %s)"

_ranks: dict[int, int] = {}
"""pid -> global rank of the workers started while the logs are rewritten."""


def remember_ranks(pids: dict[int, int], envs: dict[int, dict[str, str]]) -> None:
    """Record the global rank of each worker (``{local_rank: pid}``, the envs it got)."""
    for local_rank, pid in pids.items():
        rank = envs.get(local_rank, {}).get("RANK", "")
        if rank.isdigit():
            _ranks[int(pid)] = int(rank)


class GlobalRankFilter(logging.Filter):
    """Rewrites torch's ``failed (exitcode: ...) local_rank: L (pid: P)`` records."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode:")
                and LOCAL in record.msg and isinstance(args, tuple) and len(args) >= 3):
            rank = _ranks.get(args[2]) if isinstance(args[2], int) else None
            if rank is not None:
                record.msg = record.msg.replace(LOCAL, GLOBAL, 1)
                record.args = (args[0], rank, *args[1:])
        return True


@contextlib.contextmanager
def global_ranks_in_logs() -> Iterator[None]:
    """While the block runs, torch's failed-worker lines name the global rank."""
    from elastic_train.agent.torch_seams import process_start_wrapped

    def started(context: Any) -> None:
        with contextlib.suppress(Exception):  # a log nicety: never stop a start
            remember_ranks(context.pids(), context.envs)

    log_filter = GlobalRankFilter()
    logger = logging.getLogger(TORCH_LOGGER)
    logger.addFilter(log_filter)
    try:
        with process_start_wrapped(started):
            yield
    finally:
        logger.removeFilter(log_filter)
