"""Built-in tasks and the Task protocol that user tasks implement."""

from elastic_train.tasks.base import Task, TaskContext

BUILTIN_TASKS: dict[str, str] = {"gpt": "elastic_train.tasks.gpt:make_task"}

__all__ = ["BUILTIN_TASKS", "Task", "TaskContext"]
