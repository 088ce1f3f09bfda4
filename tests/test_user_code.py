"""A --task or --model file that fails to import is one line naming the user's file:line and why
(exit 2), whatever the failure: a syntax error, a missing dependency, an exception at import. A
Task method that fails while TensorFlow traces it is one line too, naming the method and the
user's file:line, with the whole traceback in <model_dir>/errors/."""

from __future__ import annotations

import sys

import pytest
from helpers import TASKS_REFUSED, TINY_FLAGS, explain, run_cli, small_config

from engine.controller.trainer import train
from engine.errors import StepFailed, UserError
from engine.user_code import load_object

FILES = {
    "syntax": ("import os\nclass Broken(\n", 2, "SyntaxError"),
    "dependency": ("import os\nimport no_such_dependency_here\n", 2, "ModuleNotFoundError: No module named"),
    "exception": ("x = 1\ny = 2\nraise RuntimeError('boom at import')\n", 3, "RuntimeError: boom at import"),
}


def _write(tmp_path, case):
    text, line, why = FILES[case]
    path = tmp_path / f"user_{case}.py"
    path.write_text(text)
    return path, line, why


@pytest.mark.fast
@pytest.mark.parametrize("case", sorted(FILES))
def test_a_file_that_fails_to_import_names_its_line(tmp_path, case):
    path, line, why = _write(tmp_path, case)
    with pytest.raises(UserError) as raised:
        load_object(f"{path}:Task", "task", f"{path}:Task")
    message = str(raised.value)
    assert f"{path}:{line}" in message and why in message, message
    assert not any(name.startswith("ctl_user_task_user_") for name in sys.modules)  # no half-imported module


@pytest.mark.fast
@pytest.mark.parametrize("case", sorted(FILES))
def test_a_module_that_fails_to_import_names_its_line(tmp_path, monkeypatch, case):
    path, line, why = _write(tmp_path, case)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as raised:
        load_object(f"user_{case}:Task", "model", f"user_{case}:Task")
    assert f"{path}:{line}" in str(raised.value) and why in str(raised.value), str(raised.value)


@pytest.mark.fast
def test_a_missing_module_is_still_named_as_missing():
    with pytest.raises(UserError, match="cannot import module 'no_such_module_here'"):
        load_object("no_such_module_here:Task", "task", "no_such_module_here:Task")


def test_run_py_exits_2_with_one_line_for_a_task_with_a_syntax_error(tmp_path):
    path, line, _ = _write(tmp_path, "syntax")
    proc = run_cli("--dataset=synthetic", f"--task={path}:Broken", f"--model_dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{path}:{line}" in last, explain(proc)


def _line_of(marker: str) -> int:
    return next(n for n, text in enumerate(open(TASKS_REFUSED), 1) if marker in text)


@pytest.mark.parametrize(
    "task, method, marker, strategy",
    [
        ("ShapeMistakeInTrainStepTask", "train_step", "TRAIN_STEP MISTAKE", {}),
        ("KeyMistakeInEvalStepTask", "eval_step", "EVAL_STEP MISTAKE", {"strategy": "mirrored", "cpu_replicas": 2}),
    ],
)
def test_a_task_method_failing_while_traced_is_one_line_with_the_traceback_in_errors(
    tmp_path, task, method, marker, strategy
):
    with pytest.raises(StepFailed) as raised:
        train(small_config(tmp_path, model="mlp", task=f"{TASKS_REFUSED}:{task}", **strategy))
    message = str(raised.value)
    assert message.startswith(f"{method} failed while TensorFlow traced"), message
    assert f"tasks_refused.py:{_line_of(marker)}" in message and "\n" not in message, message
    assert raised.value.exit_code == 2
    (written,) = (tmp_path / "errors").iterdir()
    assert str(written) in message
    text = written.read_text()
    assert "Traceback" in text and marker in text  # the whole traceback, the user's line in it


def test_run_py_exits_2_with_one_line_for_a_step_that_fails_while_traced(tmp_path):
    proc = run_cli(
        *TINY_FLAGS,
        f"--task={TASKS_REFUSED}:ShapeMistakeInTrainStepTask",
        f"--model_dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train_step failed while TensorFlow traced the training loop, at ")
    assert f"tasks_refused.py:{_line_of('TRAIN_STEP MISTAKE')}" in last and "errors/traced-" in last, explain(proc)
