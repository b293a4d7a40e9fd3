"""Resolve ``--task`` (a built-in name or ``package.module:factory``) into a Task."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from elastic_train.errors import ConfigError, TaskError
from elastic_train.tasks import BUILTIN_TASKS
from elastic_train.tasks.base import Task, TaskContext

_REQUIRED = ("build_model", "build_dataset", "build_optimizer", "loss")


def resolve_factory(spec: str) -> Callable[[TaskContext], Task]:
    """Import the factory that ``spec`` names."""
    target = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"--task {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)})"
                        " nor of the form package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"--task {spec!r} cannot be imported ({exc}): check that {module_name!r}"
                        " is installed or on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"--task {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def load_task(spec: str, ctx: TaskContext) -> Task:
    """Build the task; check it has what the trainer calls."""
    factory = resolve_factory(spec)
    try:
        task = factory(ctx)
    except (ConfigError, TaskError):
        raise
    except Exception as exc:
        raise TaskError(f"--task {spec!r}: its factory failed ({type(exc).__name__}: {exc})") \
            from exc
    missing = [name for name in _REQUIRED if not callable(getattr(task, name, None))]
    if missing:
        raise TaskError(f"--task {spec!r} returned {type(task).__name__}, which lacks "
                        f"{', '.join(missing)} of the Task protocol (see elastic_train.Task)")
    return task
