"""Loads what a flag names outside the registries: `package.module:NAME` or `path/to/file.py:NAME`.

Shared by `--task` (engine/tasks/registry.py) and `--model` (engine/models/registry.py). Errors
are UserErrors that name the flag and its value, e.g. `--model='x.py:build': no such file x.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
import traceback

from engine.errors import StepFailed, StopRun, UserError


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
        if err.name is not None and name.startswith(err.name):  # the module itself (or its package)
            raise UserError(f"--{flag}={value!r}: cannot import module {name!r} ({err})") from None
        raise _import_failed(err, flag, value, name) from None
    except Exception as err:  # a syntax error or an exception while the module ran
        raise _import_failed(err, flag, value, name) from None


def _import_file(path: str, flag: str, value: str):
    if not os.path.isfile(path):
        raise UserError(f"--{flag}={value!r}: no such file {path}")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_name = f"ctl_user_{flag}_{stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # a syntax error, a missing import, an exception at import
        del sys.modules[module_name]
        raise _import_failed(err, flag, value, path) from None
    return module


def _import_failed(err: Exception, flag: str, value: str, what: str) -> UserError:
    """One line for a user file or module that failed to import: where (file:line of the user's
    code, the deepest frame outside the engine) and why."""
    if isinstance(err, SyntaxError) and err.filename:
        where = f"{_shown(err.filename)}:{err.lineno}"
        why = f"{type(err).__name__}: {err.msg}"
    else:
        where = user_frame(err) or what
        why = f"{type(err).__name__}: {err}"
    return UserError(f"--{flag}={value!r}: importing {what} failed at {where}: {why}")


_ENGINE = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = tuple(
    {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
)


def _is_ours(filename: str) -> bool:
    """The engine's frames, the standard library's and installed packages' (TensorFlow, Keras),
    the import machinery's and autograph's generated code: never the place of a user's mistake."""
    return (
        filename.startswith(_ENGINE + os.sep)
        or filename.startswith("<")
        or "site-packages" in filename
        or "__autograph_generated" in filename
        or filename.startswith(_LIBRARIES)
    )


def user_frame(err: BaseException) -> str:
    """file:line of the deepest frame of user code in `err`'s traceback, or in the "File ..., line N"
    lines TensorFlow puts in the message of an error raised while tracing; "" if none."""
    return user_site(err)[0]


def user_site(err: BaseException) -> tuple[str, str]:
    """(file:line, function) of the deepest frame of user code, as user_frame finds it; ("", "") if none."""
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)]
    frames += [
        (name, int(line), function)
        for name, line, function in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', str(err))
    ]
    found = [frame for frame in frames if not _is_ours(frame[0])]
    return (f"{_shown(found[-1][0])}:{found[-1][1]}", found[-1][2]) if found else ("", "")


def _shown(filename: str) -> str:
    """A path relative to the working directory when it is below it (as the user wrote it)."""
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


@contextlib.contextmanager
def step_errors_named(loop: str, eager: bool = False):
    """Around a call of a compiled loop (`loop` names it, e.g. "the training loop"): an exception
    raised in user code while TensorFlow traced a Task method becomes StepFailed, one line naming
    the method and the user's file:line. Errors the step raised at run time (tf.errors.OpError),
    the engine's own refusals (StopRun) and errors with no user frame (the engine's) pass as they are.
    eager: the loop runs as Python (--run_eagerly), so the error came while running, not tracing."""
    when = f"while {loop} ran eagerly" if eager else f"while TensorFlow traced {loop}"
    with _user_errors_named(lambda function: f"{function} failed {when}", op_errors_pass=True):
        yield


@contextlib.contextmanager
def host_errors_named(method: str):
    """Around a Task method the engine calls on the host between loops (`method` names it, e.g.
    "eval_summary"): an exception raised in user code becomes StepFailed, one line naming the
    method and the user's file:line (its whole traceback goes to errors/)."""
    with _user_errors_named(lambda function: f"{method} failed", op_errors_pass=False):
        yield


@contextlib.contextmanager
def _user_errors_named(failed_text, op_errors_pass: bool):
    try:
        yield
    except StopRun:
        raise
    except Exception as err:  # noqa: BLE001 - only those with a user frame are converted
        import tensorflow as tf

        where, function = user_site(err)
        if (op_errors_pass and isinstance(err, tf.errors.OpError)) or not where:
            raise
        metadata = getattr(err, "ag_error_metadata", None)
        cause = getattr(metadata, "cause_message", None) or str(err)
        first_line = (cause.strip().splitlines() or [""])[0].removeprefix(f"{type(err).__name__}: ")[:300]
        failed = StepFailed(f"{failed_text(function)}, at {where}: {type(err).__name__}: {first_line}")
        failed.traceback_text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        raise failed from None
