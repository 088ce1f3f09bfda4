"""--preflight: what a run reaches only after training (an evaluation with the Task's summaries,
the export's serving signature, the checkpoint) is tried on one batch first, so a Task's mistake
there stops the run before the first training loop with the line it would print after training;
and the preflight changes nothing of the run."""

from __future__ import annotations

import os

import pytest
from helpers import (
    QUIET,
    TASKS_REFUSED,
    TINY_FLAGS,
    explain,
    max_difference,
    run_cli,
    small_config,
    trained_by_name,
)

from engine.controller.trainer import train
from engine.errors import ExtraFailed, StepFailed


def _checkpoints(model_dir) -> list:
    directory = os.path.join(model_dir, "checkpoints")
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-")) if os.path.isdir(directory) else []


@pytest.mark.parametrize("preflight", [True, False])
def test_an_eval_step_mistake_stops_the_run_before_training_only_with_the_preflight(tmp_path, preflight):
    config = small_config(tmp_path, model="mlp", task=f"{TASKS_REFUSED}:KeyMistakeInEvalStepTask", preflight=preflight)
    with pytest.raises(StepFailed, match="eval_step failed while TensorFlow traced the evaluation loop"):
        train(config, **QUIET)
    # With the preflight nothing was trained; without it the mistake shows after the whole training.
    assert _checkpoints(tmp_path) == ([] if preflight else ["ckpt-6.data-00000-of-00001", "ckpt-6.index"])


def test_an_unservable_export_stops_the_run_before_training(tmp_path):
    config = small_config(
        tmp_path, model="mlp", task=f"{TASKS_REFUSED}:UnservableModelTask", export=True, export_formats="saved_model"
    )
    with pytest.raises(ExtraFailed, match="the export failed at step 0") as raised:
        train(config, **QUIET)
    assert "tasks_refused.py" in str(raised.value)
    assert _checkpoints(tmp_path) == []


def test_an_eval_summary_mistake_is_one_line_exit_2_before_training(tmp_path):
    proc = run_cli(
        *TINY_FLAGS,
        "--train_steps=4",
        f"--task={TASKS_REFUSED}:EvalSummaryMistakeTask",
        f"--model_dir={tmp_path}",
        "--noexport",
        timeout=180,
    )
    assert proc.returncode == 2, explain(proc)
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: EvalSummaryMistakeTask.eval_summary failed, at "), explain(proc)
    assert "tasks_refused.py:" in line and "AttributeError" in line and "errors/" in line, line
    assert "Traceback" not in proc.stderr, explain(proc)
    assert " step 2/4 " not in proc.stdout and _checkpoints(tmp_path) == [], explain(proc)


def test_the_preflight_changes_nothing_of_the_run(tmp_path):
    flags = dict(model="mlp", summaries="full", strategy="mirrored", cpu_replicas=2)
    checked = trained_by_name(tmp_path / "checked", **flags)
    unchecked = trained_by_name(tmp_path / "unchecked", **flags, preflight=False)
    assert max_difference(checked, unchecked) == 0.0
    assert sorted(os.listdir(tmp_path / "checked")) == sorted(os.listdir(tmp_path / "unchecked"))
    result = train(small_config(tmp_path / "again", **flags), **QUIET)
    other = train(small_config(tmp_path / "again2", **flags, preflight=False), **QUIET)
    assert result.eval_metrics == other.eval_metrics


@pytest.mark.parametrize("collects", [False, True])
def test_the_preflights_batch_runs_the_trace_every_evaluation_then_uses(tmp_path, collects):
    """The one-batch eval data has the eval data's element spec: the preflight costs no second trace."""
    from engine.data import pipelines, sources
    from engine.distribute.strategy import build_strategy
    from engine.loop import make_eval_loop
    from engine.task import Task
    from tasks_collect import RecordingAucF1Task

    config = small_config(tmp_path, model="mlp", strategy="mirrored", cpu_replicas=2)
    strategy = build_strategy("mirrored", 2).strategy
    source = sources.load(config)
    with strategy.scope():
        task = (RecordingAucF1Task if collects else Task)(config, spec=source.spec)
        task.model = task.build_model()
    eval_loop = make_eval_loop(strategy, task)
    first = eval_loop(pipelines.distributed_eval_batches(strategy, source, config, 1))
    whole = eval_loop(pipelines.distributed_eval_data(strategy, source, config))
    assert int(first["examples"]) == 64 and int(whole["examples"]) == 300
    assert eval_loop.experimental_get_tracing_count() == 1
