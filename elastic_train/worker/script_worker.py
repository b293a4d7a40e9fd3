"""A user's training script as a worker of ``elastic-train run`` (torchrun's script form).

``elastic-train run [options] train.py [its arguments]`` runs ``train.py`` in every worker,
as ``torchrun`` would, but under our agent (``-m pkg.module`` runs a module, as
``python -m``). The script runs as ``__main__`` with ``sys.argv`` set to it and its
arguments, and its directory first on ``sys.path``, as ``python train.py`` would run it.
Forkserver workers call ``run_script`` / ``run_module``; subprocess workers run
``python -u -m elastic_train.worker.script_worker [-m] TARGET ARGS`` (``main``).

An unmodified script gets the restart path and nothing else; its process groups are kept
until the process ends and the process ends without the interpreter's teardown
(``aborts.groups_kept_until_exit``: a gloo group freed right after the last
``backward()`` can deadlock the worker, or abort it at exit).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from elastic_train.worker.aborts import groups_kept_until_exit
from elastic_train.worker.env import read_worker_env
from elastic_train.worker.process_name import name_process

MODULE_FLAG = "-m"
"""``main``'s first argument when the target is a module (torchrun's ``-m``)."""


def exit_code(value: object) -> int:
    """The status ``SystemExit(value)`` ends a process with (``sys.exit``'s rules)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr, flush=True)
    return 1


@record
def _run(target: str, args: Sequence[str], module: bool) -> int:
    """Run the script (or module) as ``__main__``; its exit status."""
    if module:
        sys.argv = [target, *args]  # runpy sets argv[0] to the module's file
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        with groups_kept_until_exit():
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc.code)
    return 0


def _forked(target: str, args: Sequence[str], module: bool) -> None:
    """A forkserver worker: run the target; a failure is an exit status.

    A failure must be an exit status, not a return value, for the agent to restart. On
    success the worker returns to torch's launcher, which hands the agent its result; the
    forked process then ends with ``os._exit`` either way (multiprocessing's way): no
    interpreter teardown frees the groups the script kept.
    """
    name_process(read_worker_env().rank)
    code = _run(target, args, module)
    if code:
        sys.exit(code)


def run_script(path: str, *args: str) -> None:
    """Function entrypoint for torch's elastic launcher: run the script in this worker."""
    _forked(path, args, module=False)


def run_module(name: str, *args: str) -> None:
    """Function entrypoint for torch's elastic launcher: run the module in this worker."""
    _forked(name, args, module=True)


def main(argv: Sequence[str]) -> int:
    """``python -m elastic_train.worker.script_worker [-m] TARGET ARGS``: a subprocess worker."""
    module = bool(argv) and argv[0] == MODULE_FLAG
    target, *args = argv[1:] if module else argv
    if not module and sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)  # ``python -m`` put the working directory there; ``python
        # train.py`` would not (the script's directory goes first instead)
    name_process(read_worker_env().rank)
    try:
        return _run(target, args, module)
    except BaseException:  # what ``python train.py`` prints, then its status
        traceback.print_exc()
        return 1


def end_process(code: int) -> NoReturn:
    """End a subprocess worker as ``python train.py`` would (its other threads joined,
    atexit handlers run, output flushed, the script's status), minus the interpreter's
    teardown: that would free the groups the script kept (the deadlock above), or end
    gloo's threads while they wait for the GIL ("terminate called without an active
    exception", SIGABRT, seen under torchrun). Hence ``os._exit``."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # prints what a handler raises and goes on, as at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
