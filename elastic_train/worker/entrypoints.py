"""The built-in job's worker entry point as the agent names it.

torch's elastic launcher hands a forkserver worker its entry point by reference (its module
and name, pickled); the forkserver imported the training code already
(agent/worker_start.py ``PRELOAD``). Naming ``elastic_train.worker.train.run_worker`` would
make the agent import that code too, which it never runs: 1.4 s of a rejoining agent's
start on a loaded 2-core machine, on the way to its rendezvous. This module imports nothing.
"""

from __future__ import annotations

__all__ = ["run_worker"]


def run_worker(*argv: str) -> None:
    """``elastic_train.worker.train.run_worker``, imported where it runs: in the worker."""
    from elastic_train.worker.train import run_worker as run

    run(*argv)
