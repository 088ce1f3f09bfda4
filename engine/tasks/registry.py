"""Resolves `--task`: a registered name, `package.module:Class`, or `path/to/file.py:Class`."""

from __future__ import annotations

from engine.errors import UserError
from engine.task import Task
from engine.user_code import load_object

TASKS = {
    "classification": "engine.task:Task",
    "label_smoothing": "engine.tasks.label_smoothing:LabelSmoothingTask",  # the worked example of a changed step
    "language_model": "engine.tasks.language_model:LanguageModelTask",  # byte Transformer, per-token loss
}


def load_task_class(spec: str) -> type:
    target = TASKS.get(spec, spec)
    if ":" not in target:
        raise UserError(
            f"unknown --task={spec!r}; use a registered name ({', '.join(sorted(TASKS))}), "
            "package.module:ClassName or path/to/file.py:ClassName"
        )
    cls = load_object(target, "task", spec)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"--task={spec!r}: {target.rpartition(':')[2]} is not a subclass of engine.task.Task")
    return cls
