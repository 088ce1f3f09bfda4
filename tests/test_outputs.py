"""Several model outputs: the Task names the one with the class logits (classifier_output) and the
classification pictures use it; without it they are off with one banner line, never a failure after
training. A failing extra names the user's file:line and keeps its whole traceback in errors/."""

from __future__ import annotations

import io
import os

import pytest
import tensorflow as tf
from helpers import REPO, max_difference, small_config, tensorboard_run, trained_by_name

from engine.controller.trainer import train
from engine.errors import ExtraFailed

TASKS = os.path.join(REPO, "tests", "tasks_outputs.py")


def _train(tmp_path, task, **changes):
    out = io.StringIO()
    result = train(small_config(tmp_path, task=f"{TASKS}:{task}", **changes), out=out)
    return result, out.getvalue()


def _eval_tags(tmp_path):
    return set(tensorboard_run(tmp_path / "eval").Tags()["tensors"])


@pytest.mark.parametrize("task", ["TwoHeadedTask", "TwoHeadedByIndexTask"])
def test_a_two_headed_classifier_draws_the_pictures_of_its_classifier_output(tmp_path, task):
    result, printed = _train(tmp_path, task)
    assert result.final_step == 6 and 0 <= result.eval_metrics["accuracy"] <= 1
    assert "confusion_matrix" in _eval_tags(tmp_path)
    assert "pictures off" not in printed


def test_a_multi_output_model_without_classifier_output_finishes_with_the_pictures_off(tmp_path):
    result, printed = _train(
        tmp_path,
        "TwoHeadedUnnamedTask",
        strategy="mirrored",
        cpu_replicas=2,
        export=True,
        export_formats="saved_model",
    )
    assert result.final_step == 6
    served = tf.saved_model.load(str(tmp_path / "export" / "saved_model" / "6")).signatures["serving_default"]
    assert set(served.structured_outputs) == {"outputs_0", "outputs_1"}  # docs/serving.md names them
    notes = [line for line in printed.splitlines() if "classification pictures off" in line]
    assert len(notes) == 1 and "classifier_output" in notes[0], printed
    assert "confusion_matrix" not in _eval_tags(tmp_path)


def test_a_failing_extra_names_the_users_line_and_keeps_the_traceback(tmp_path):
    with pytest.raises(ExtraFailed) as raised:
        _train(tmp_path, "FailingSummaryTask", model="mlp")
    line = next(n for n, text in enumerate(open(TASKS), 1) if "LINE OF THE FAILURE" in text)
    message = str(raised.value)
    assert f"tasks_outputs.py:{line}" in message and "KeyError" in message and "\n" not in message, message
    written = os.listdir(tmp_path / "errors")
    assert len(written) == 1
    with open(tmp_path / "errors" / written[0]) as f:
        assert "Traceback" in f.read()
    assert "rerun the same command" not in message  # the same failure would come back


def test_the_two_headed_example_on_two_replicas_trains_like_one_and_resumes_exactly(tmp_path):
    task = f"{REPO}/examples/two_heads.py:TwoHeadedTask"
    one = trained_by_name(tmp_path / "one", task=task)
    two = trained_by_name(tmp_path / "two", task=task, strategy="mirrored", cpu_replicas=2)
    assert max_difference(one, two) < 1e-5
    train(small_config(tmp_path / "resumed", task=task, train_steps=3), out=io.StringIO())
    resumed = trained_by_name(tmp_path / "resumed", task=task)
    assert max_difference(one, resumed) == 0.0
