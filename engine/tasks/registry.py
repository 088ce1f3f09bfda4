"""Resolves `--task`: a registered name, `package.module:Class`, or `path/to/file.py:Class`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from engine.errors import UserError
from engine.task import Task

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
    where, _, class_name = target.rpartition(":")
    module = _import_file(where, spec) if where.endswith(".py") else _import_module(where, spec)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UserError(f"--task={spec!r}: {where} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"--task={spec!r}: {class_name} is not a subclass of engine.task.Task")
    return cls


def _import_module(name: str, spec: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise UserError(f"--task={spec!r}: cannot import module {name!r} ({err})") from None


def _import_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise UserError(f"--task={spec!r}: no such file {path}")
    module_name = "ctl_user_task_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    return module
