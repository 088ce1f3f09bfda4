"""The action seam: an action sees only a frozen ActionContext and returns what it produces.
Early stopping decides from contexts built by hand at explicit steps (no training); a Task's own
action gets its returns kept, sees the engine actions' returns, and its checkpoint request is
honoured; no action module reaches into the trainer."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import pathlib
import re

import pytest
import tensorflow as tf
from helpers import REPO, TASKS_ACTIONS, small_config

from engine.controller.actions.base import EMA_EVALUATION, ActionContext
from engine.controller.actions.early_stopping import EarlyStopping
from engine.controller.trainer import train


METRICS = ("loss", "accuracy")


def _early_stopping(tmp_path, is_chief=False, **overrides):
    config = small_config(
        tmp_path, best_metric="accuracy", early_stopping_patience=2, early_stopping_min_delta=0.01, **overrides
    )
    return config, EarlyStopping(config, METRICS, is_chief=is_chief)


def _evaluations(action, config, accuracies: dict, **context) -> list:
    """Calls action.after_eval at each {step: accuracy}; the stop reasons it asked for."""
    stops = []
    for step, accuracy in accuracies.items():
        action.after_eval(
            ActionContext(
                step=step, config=config, eval_metrics={"accuracy": accuracy}, request_stop=stops.append, **context
            )
        )
    return stops


def test_early_stopping_decides_from_explicit_steps(tmp_path):
    config, action = _early_stopping(tmp_path)
    assert _evaluations(action, config, {10: 0.5, 20: 0.6, 30: 0.605}) == []  # 0.005 < min_delta: waited 1
    assert _evaluations(action, config, {40: 0.6}) == [
        "early stopping at step 40: accuracy did not improve by 0.01 or more in 2 evaluations (best 0.6000)"
    ]
    assert not os.path.exists(tmp_path / "early_stopping.json")  # only the chief writes it


def test_early_stopping_on_the_chief_records_the_count_and_takes_it_up_on_resume(tmp_path):
    config, action = _early_stopping(tmp_path, is_chief=True)
    _evaluations(action, config, {10: 0.5, 20: 0.4, 30: 0.45})
    record = json.loads((tmp_path / "early_stopping.json").read_text())
    assert record["history"][-1] == {"step": 30, "best": 0.5, "waited": 2} and record["stopped_at"] == 30
    resumed = EarlyStopping(config, METRICS, is_chief=True)
    resumed.resume_at(20)  # the checkpoint of step 20: one evaluation waited, not two
    assert (resumed.best, resumed.waited) == (0.5, 1)
    assert _evaluations(resumed, config, {30: 0.7}) == [] and resumed.waited == 0


def test_with_ema_early_stopping_judges_the_ema_evaluation_an_earlier_action_returned(tmp_path):
    config, action = _early_stopping(tmp_path, ema_decay=0.99)
    # The raw weights improve, the EMA weights (what is judged) do not.
    stops = []
    for step, (raw, ema) in {10: (0.5, 0.5), 20: (0.7, 0.5), 30: (0.9, 0.5)}.items():
        context = ActionContext(
            step=step,
            config=config,
            eval_metrics={"accuracy": raw},
            outputs={EMA_EVALUATION: {"accuracy": ema}},
            request_stop=stops.append,
        )
        assert context.selection_metrics == {"accuracy": ema}
        action.after_eval(context)
    assert len(stops) == 1 and stops[0].startswith("early stopping at step 30:")


@pytest.mark.fast
def test_the_context_is_frozen_and_its_dicts_are_read_only_copies(tmp_path):
    metrics = {"accuracy": 0.5}
    context = ActionContext(step=3, config=small_config(tmp_path), eval_metrics=metrics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.step = 4
    with pytest.raises(TypeError):
        context.eval_metrics["accuracy"] = 1.0
    metrics["accuracy"] = 0.9  # the trainer's dict moves on; the context keeps what it was given
    assert context.eval_metrics == {"accuracy": 0.5}
    with pytest.raises(RuntimeError, match="built without request_stop"):
        context.request_stop("why")


def test_the_documented_action_decides_from_explicit_steps(tmp_path):
    """docs/research-run.md's example action, as written, on contexts built by hand."""
    page = pathlib.Path(REPO, "docs", "research-run.md").read_text()
    code = re.search(r"```python\n(.*?)```", page[page.index("## Your own actions") :], re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/research-run.md", "exec"), namespace)
    action, config, reasons, lines = namespace["LossFloor"](), small_config(tmp_path), [], []
    for step, loss in ((100, 0.2), (200, 0.01)):
        context = ActionContext(step=step, config=config, train_metrics={"loss": loss}, request_stop=reasons.append)
        assert action.after_loop(context) == {"step": step, "loss": loss}
    assert reasons == ["loss 0.0100 below 0.05 at step 200"]
    action.after_eval(ActionContext(step=200, config=config, eval_metrics={"accuracy": 0.5}, message=lines.append))
    assert lines == ["accuracy now 0.5000"]
    assert [type(a).__name__ for a in namespace["MyTask"](config, input_shape=(4,), num_classes=2).actions()] == [
        "LossFloor"
    ]


def test_a_tasks_action_returns_are_kept_and_its_checkpoint_request_is_honoured(tmp_path):
    out = io.StringIO()
    result = train(
        small_config(
            tmp_path, task=f"{TASKS_ACTIONS}:RecordingActionTask", model="mlp", best_metric="accuracy", export=True
        ),
        out=out,
    )
    outputs = result.action_outputs
    # Its at_end ran after the engine's actions (export last of them) and saw their returns.
    assert outputs["RecordingAction"] == {"step": 6, "seen": ["RecordingAction", "best", "export"]}
    assert outputs["best"]["step"] == 6 and outputs["best"]["metric"] == "accuracy"
    assert result.export_path == outputs["export"][0] == str(tmp_path / "export" / "model.keras")
    state = tf.train.get_checkpoint_state(str(tmp_path / "checkpoints"))
    saved = [os.path.basename(path) for path in state.all_model_checkpoint_paths]
    assert saved == ["ckpt-3", "ckpt-6"], out.getvalue()  # ckpt-3: the action's request only


def test_no_action_imports_the_trainer_or_reads_a_private_attribute():
    """The seam: actions see an ActionContext, never the trainer or its built run."""
    for path in sorted(pathlib.Path(REPO, "engine", "controller", "actions").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & {"engine.controller.trainer", "engine.controller.build"}, path.name
        private = [
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            if not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ]
        assert not private, f"{path.name} reads {private}"
