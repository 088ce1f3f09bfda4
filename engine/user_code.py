"""Loads what a flag names outside the registries: `package.module:NAME` or `path/to/file.py:NAME`.

Shared by `--task` (engine/tasks/registry.py) and `--model` (engine/models/registry.py). Errors
are UserErrors that name the flag and its value, e.g. `--model='x.py:build': no such file x.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

from engine.errors import UserError


def load_object(target: str, flag: str, value: str):
    """The object `NAME` of `target` = `package.module:NAME` or `path/to/file.py:NAME`.

    `flag` and `value` are what the user wrote (e.g. "task", "mine.py:MyTask"): errors name them.
    """
    where, _, name = target.rpartition(":")
    module = _import_file(where, flag, value) if where.endswith(".py") else _import_module(where, flag, value)
    found = getattr(module, name, None)
    if found is None:
        raise UserError(f"--{flag}={value!r}: {where} has no attribute {name!r}")
    return found


def _import_module(name: str, flag: str, value: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise UserError(f"--{flag}={value!r}: cannot import module {name!r} ({err})") from None


def _import_file(path: str, flag: str, value: str):
    if not os.path.isfile(path):
        raise UserError(f"--{flag}={value!r}: no such file {path}")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_name = f"ctl_user_{flag}_{stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    return module
