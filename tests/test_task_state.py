"""A Task with several models and optimizers keeps every guarantee (invariants 4, 5, 11, 12):
its whole state is checkpointed and restored, every optimizer goes through the engine's one
all-reduce, finite check, clipping, loss scaling and accumulation, a resume that does not match is
refused, collectives in a step come from engine helpers, and a failing extra keeps the checkpoint."""

from __future__ import annotations

import io
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    QUIET,
    TASKS_REFUSED,
    TASKS_STATE,
    checkpoint_state,
    explain,
    max_difference,
    run_cli,
    small_config,
    small_flags,
    tensorboard_run,
)

from engine.controller.state import create_state
from engine.controller.trainer import train
from engine.distribute.strategy import build_strategy
from engine.errors import ExtraFailed, UserError
from engine.task_state import top_level_names
from tasks_state import SecondModelTask

TWO = dict(strategy="mirrored", cpu_replicas=2)
PROBE = f"{TASKS_STATE}:ProbeTask"
STATE = ("model/", "optimizer/", "task/")


def _config(tmp_path, name="run", **overrides):
    return small_config(tmp_path / name, **{"task": PROBE, "model": "mlp", **overrides})


def _iterations(model_dir, node) -> int:
    """The `iterations` counter of the optimizer checkpointed under `node` ("optimizer" or
    "task/probe_optimizer")."""
    state = checkpoint_state(model_dir, prefixes=(node + "/",))
    return int(next(v for k, v in state.items() if k.startswith(node + "/_iterations")))


def _task_state_names(model_dir) -> set:
    latest = tf.train.latest_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    return top_level_names(latest, "task")


def _state_difference(a: dict, b: dict) -> float:
    """max_difference of two checkpoint states that hold the probe (its kernel is stored once, under
    the first path to it: its optimizer's)."""
    assert any(k.startswith("task/") and a[k].shape == (784, 10) for k in a)
    return max_difference(a, b)


def test_the_checkpoint_holds_every_model_and_optimizer_the_task_holds(tmp_path):
    train(_config(tmp_path), **QUIET)
    assert _task_state_names(tmp_path / "run") == {"probe", "probe_optimizer"}
    assert _iterations(tmp_path / "run", "task/probe_optimizer") == 6
    assert _iterations(tmp_path / "run", "optimizer") == 6


def test_a_resumed_two_optimizer_run_equals_an_uninterrupted_one(tmp_path):
    train(_config(tmp_path, "resumed"), **QUIET)
    train(_config(tmp_path, "resumed", train_steps=12), **QUIET)
    train(_config(tmp_path, "straight", train_steps=12), **QUIET)
    resumed = checkpoint_state(tmp_path / "resumed", STATE)
    assert _state_difference(resumed, checkpoint_state(tmp_path / "straight", STATE)) <= 1e-6
    assert _iterations(tmp_path / "resumed", "task/probe_optimizer") == 12


def test_two_replicas_train_both_models_like_one(tmp_path):
    train(_config(tmp_path, "two", **TWO), **QUIET)
    train(_config(tmp_path, "one", strategy="default"), **QUIET)
    assert (
        _state_difference(checkpoint_state(tmp_path / "two", STATE), checkpoint_state(tmp_path / "one", STATE)) <= 1e-5
    )


def test_accumulated_micro_batches_train_both_models_like_the_whole_batch(tmp_path):
    train(_config(tmp_path, "accum", grad_accum_steps=2, **TWO), **QUIET)
    train(_config(tmp_path, "whole", **TWO), **QUIET)
    assert (
        _state_difference(checkpoint_state(tmp_path / "accum", STATE), checkpoint_state(tmp_path / "whole", STATE))
        <= 1e-5
    )


def test_when_steps_an_optimizer_only_where_it_is_true(tmp_path):
    train(_config(tmp_path, task=f"{TASKS_STATE}:EveryOtherProbeTask", **TWO), **QUIET)
    assert _iterations(tmp_path / "run", "task/probe_optimizer") == 3
    assert _iterations(tmp_path / "run", "optimizer") == 6


def test_a_non_finite_gradient_of_one_optimizer_skips_the_whole_update(tmp_path):
    """The probe's gradients are NaN on one replica at the 4th step: neither model nor optimizer moves."""
    result = train(
        _config(
            tmp_path,
            task=f"{TASKS_STATE}:PoisonedProbeTask",
            on_nonfinite="skip",
            train_steps=4,
            steps_per_loop=1,
            checkpoint_every=1,
            keep_checkpoints=5,
            **TWO,
        ),
        **QUIET,
    )
    assert result.skipped_steps == 1
    directory = os.path.join(tmp_path, "run", "checkpoints")
    before, after = (tf.train.load_checkpoint(os.path.join(directory, f"ckpt-{n}")) for n in (3, 4))
    names = [n for n, _ in tf.train.list_variables(os.path.join(directory, "ckpt-4")) if n.startswith(STATE)]
    assert any(n.startswith("task/probe_optimizer/") for n in names)
    for name in names:
        np.testing.assert_array_equal(before.get_tensor(name), after.get_tensor(name), err_msg=name)


def test_each_optimizer_has_its_grad_norm_and_is_clipped_by_its_own_norm(tmp_path):
    def probe_change(name, **overrides):
        train(_config(tmp_path, name, train_steps=2, steps_per_loop=1, checkpoint_every=1, **overrides), **QUIET)
        directory = os.path.join(tmp_path, name, "checkpoints")
        first, second = (tf.train.load_checkpoint(os.path.join(directory, f"ckpt-{n}")) for n in (1, 2))
        kernel = "task/probe_optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"  # the probe's kernel
        return float(np.linalg.norm(second.get_tensor(kernel) - first.get_tensor(kernel)))

    result = train(_config(tmp_path), **QUIET)
    assert result.train_metrics["grad_norm/probe_optimizer"] > 0
    assert result.train_metrics["grad_norm/probe_optimizer"] != result.train_metrics["grad_norm"]
    clip = 1e-3
    # SGD with momentum 0.9 and rate 0.05 moves a weight by at most 0.05 * (0.9 + 1) * clip in step 2.
    assert probe_change("clipped", clip_norm=clip) <= 0.05 * 1.9 * clip * 1.001
    assert probe_change("free") > 10 * 0.05 * 1.9 * clip


def test_mixed_float16_scales_every_optimizer(tmp_path):
    result = train(_config(tmp_path, precision="mixed_float16"), **QUIET)
    assert np.isfinite(result.train_metrics["probe_loss"])
    assert _iterations(tmp_path / "run", "task/probe_optimizer") == 6


def test_a_checkpoint_lacking_a_model_of_the_task_is_refused(tmp_path):
    train(small_config(tmp_path / "run", model="mlp"), **QUIET)
    # As if the Task's file had been edited: --allow_config_change lets a changed --task pass the run record.
    with pytest.raises(UserError, match=r"lacks the Task's self\.probe"):
        train(_config(tmp_path, train_steps=12, allow_config_change=True), **QUIET)


def test_a_checkpoint_holding_a_model_the_task_lacks_is_refused_in_one_line(tmp_path):
    model_dir = str(tmp_path / "run")
    train(_config(tmp_path), **QUIET)
    proc = run_cli(
        f"--model_dir={model_dir}",
        *small_flags(train_steps=12, model="mlp"),
        "--noexport",
        "--allow_config_change",
    )
    assert proc.returncode == 2, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert "holds self.probe" in lines[-1] and "Traceback" not in proc.stderr, explain(proc)


@pytest.mark.parametrize(
    "task, message",
    [
        ("UnbuiltOptimizerTask", r"self\.probe_optimizer is not built"),
        ("ForeignOptimizerTask", r"an optimizer the Task does not hold"),
    ],
)
def test_an_optimizer_the_engine_cannot_guard_is_refused(tmp_path, task, message):
    with pytest.raises(UserError, match=message):
        train(_config(tmp_path, task=f"{TASKS_STATE}:{task}"), **QUIET)


def test_state_no_checkpoint_can_hold_is_warned_about_once(tmp_path):
    out = io.StringIO()
    train(_config(tmp_path, task=f"{TASKS_STATE}:CountingProbeTask", train_steps=9), out=out)
    warnings = [line for line in out.getvalue().splitlines() if "self.evaluations" in line]
    assert len(warnings) == 1 and "changed during training" in warnings[0], out.getvalue()


@pytest.mark.fast
def test_an_extra_model_does_not_move_the_main_models_initial_weights(tmp_path):
    from engine.task import Task

    strategy = build_strategy("default", 1).strategy
    weights = []
    for task_class in (Task, SecondModelTask):
        keras.utils.set_random_seed(11)
        task = task_class(small_config(tmp_path, model="mlp"), input_shape=(28, 28, 1), num_classes=10)
        create_state(strategy, task, seed=11, model_dir=str(tmp_path / task_class.__name__), is_chief=True, keep=1)
        weights.append([w.numpy() for w in task.model.weights])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


COLLECTIVE = f"{TASKS_STATE}:CollectiveStepTask"


def test_step_collectives_and_example_noise_are_the_same_whatever_the_replicas(tmp_path):
    """Task.global_norm equals the engine's grad_norm; per-example noise does not depend on the replica
    count or on --grad_accum_steps (whose micro-batches then run unrolled: the norm is a collective)."""
    runs = {
        name: train(small_config(tmp_path / name, task=COLLECTIVE, model="mlp", **overrides), **QUIET)
        for name, overrides in (
            ("one", dict(strategy="default")),
            ("two", TWO),
            ("accum", dict(grad_accum_steps=2, **TWO)),
        )
    }
    one, two, accum = (runs[n].train_metrics for n in ("one", "two", "accum"))
    assert two["norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    assert two["norm"] == pytest.approx(one["norm"], rel=1e-4)
    assert two["noise"] == pytest.approx(one["noise"], rel=1e-5, abs=1e-4)
    assert accum["noise"] == pytest.approx(one["noise"], rel=1e-5, abs=1e-4)
    assert accum["loss"] == pytest.approx(two["loss"], rel=1e-5)


def test_a_step_collective_under_xla_with_mirrored_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"self\.global_norm.*drop --jit_compile"):
        train(small_config(tmp_path, task=COLLECTIVE, model="mlp", jit_compile=True, **TWO), **QUIET)


def test_a_failing_extra_ends_the_run_and_keeps_the_checkpoint_of_its_step(tmp_path):
    with pytest.raises(ExtraFailed, match=r"failed at step 6: ValueError: after_eval fails on purpose"):
        # no preflight: it would meet the failure before training (tests/test_preflight.py)
        train(
            small_config(tmp_path, task=f"{TASKS_REFUSED}:FailingAfterEvalTask", model="mlp", preflight=False), **QUIET
        )
    assert tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints")).endswith("ckpt-6")


def test_a_task_that_is_no_classifier_gets_no_confusion_matrix(tmp_path):
    def image_tags(name, task):
        train(small_config(tmp_path / name, task=task, model="mlp"), **QUIET)
        return set(tensorboard_run(tmp_path / name / "eval").Tags()["tensors"])

    assert "confusion_matrix" in image_tags("classifier", "classification")
    assert "confusion_matrix" not in image_tags("other", f"{TASKS_STATE}:NotAClassifierTask")
