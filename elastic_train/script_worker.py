"""A user's training script as a worker of ``elastic-train run`` (torchrun's script form).

``elastic-train run [options] train.py [its arguments]`` runs ``train.py`` in every worker,
as ``torchrun`` would, but under our agent: a loop written on ``ElasticSession`` then
recovers in place (live recovery) instead of restarting every worker. The script runs as
``__main__`` with ``sys.argv`` set to it and its arguments, and its directory first on
``sys.path``, as ``python train.py`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train.env import read_worker_env
from elastic_train.worker_start import name_process


def exit_code(value: object) -> int:
    """The status ``SystemExit(value)`` ends a process with (``sys.exit``'s rules)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr, flush=True)
    return 1


@record
def _run(path: str, args: Sequence[str]) -> int:
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc.code)
    return 0


def run_script(path: str, *args: str) -> None:
    """Function entrypoint for torch's elastic launcher: run the script in this worker.

    A failure must be an exit status, not a return value, for the agent to restart. The
    worker returns to torch's launcher, which hands the agent its result; the forked
    process then ends with ``os._exit`` (multiprocessing's way), so no interpreter teardown
    waits for work stuck in a process group that live recovery dropped.
    """
    name_process(read_worker_env().rank)
    code = _run(path, args)
    if code:
        sys.exit(code)
