"""State that moves once per optimizer update: Task.after_update runs once per applied update
(not per micro-batch, not for a skipped one), Task.micro_batch numbers the micro-batches, and
examples/moco.py (a momentum key encoder and a queue moved by after_update) trains on 2 replicas
with accumulation exactly like 1 replica without, and resumes exactly."""

from __future__ import annotations

import os

import pytest
from helpers import QUIET, REPO, checkpoint_state, max_difference, small_config

from engine.controller.trainer import train
from engine.errors import UserError

TASKS = os.path.join(REPO, "tests", "tasks_update.py")
MOCO = dict(task=f"{TASKS}:SmallMocoTask", model="mlp", optimizer="sgd", learning_rate=0.1)


def _task_state(model_dir) -> dict:
    return checkpoint_state(model_dir, prefixes=("task/",))


def _value(state: dict, name: str):
    return next(v for k, v in state.items() if k.startswith(f"task/{name}/"))


@pytest.mark.fast
def test_after_update_runs_once_per_applied_update_and_micro_batches_are_numbered(tmp_path):
    task = f"{TASKS}:CountingUpdatesTask"
    train(small_config(tmp_path / "k2", task=task, model="mlp", grad_accum_steps=2), **QUIET)
    state = _task_state(tmp_path / "k2")
    assert int(_value(state, "updates")) == 6  # 6 updates of 2 micro-batches each
    assert list(_value(state, "micro_batches_seen")) == [6, 6, 0, 0]


def test_a_skipped_update_runs_no_after_update(tmp_path):
    config = small_config(
        tmp_path / "skip", task=f"{TASKS}:SkippingUpdatesTask", model="mlp", on_nonfinite="skip", strategy="mirrored"
    )
    result = train(config, **QUIET)
    assert result.skipped_steps == 1
    assert int(_value(_task_state(tmp_path / "skip"), "updates")) == 5


def test_a_collective_in_after_update_is_refused_in_one_line(tmp_path):
    config = small_config(tmp_path, task=f"{TASKS}:CollectiveAfterUpdateTask", model="mlp")
    with pytest.raises(UserError, match="after_update calls self.all_reduce"):
        train(config, **QUIET)


def test_moco_on_two_replicas_with_accumulation_trains_like_one_replica(tmp_path):
    one = train(small_config(tmp_path / "one", **MOCO), **QUIET)
    two = train(
        small_config(tmp_path / "two", **MOCO, strategy="mirrored", cpu_replicas=2, grad_accum_steps=2), **QUIET
    )
    a, b = (
        checkpoint_state(tmp_path / "one", ("model/", "task/")),
        checkpoint_state(tmp_path / "two", ("model/", "task/")),
    )
    assert max_difference(a, b) < 1e-6
    assert max_difference(_value(a, "queue"), _value(b, "queue")) < 1e-6
    assert one.train_metrics["loss"] == pytest.approx(two.train_metrics["loss"], rel=1e-5)


def test_moco_resumes_exactly(tmp_path):
    train(small_config(tmp_path / "straight", **MOCO), **QUIET)
    train(small_config(tmp_path / "resumed", **MOCO, train_steps=3), **QUIET)
    train(small_config(tmp_path / "resumed", **MOCO), **QUIET)
    straight = checkpoint_state(tmp_path / "straight", ("model/", "task/"))
    resumed = checkpoint_state(tmp_path / "resumed", ("model/", "task/"))
    assert max_difference(straight, resumed) == 0.0
