"""The compiled training loop (engine/loop.py): its options, the verdict on a step, and the body's
counting (next batch -> run -> reduce -> judge -> count)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from helpers import small_config

from engine.controller.state import create_state
from engine.data.arrays import train_dataset
from engine.data.builtin import synthetic_arrays
from engine.distribute.strategy import build_strategy
from engine.loop import LoopOptions, make_train_loop, step_verdict
from engine.task import Task


NAN = float("nan")


def _verdict(update_bad=False, metrics=(1.0, 4.0), **options):
    verdict = step_verdict(tf.constant(update_bad), tf.constant(metrics), **options)
    return bool(verdict.good), int(verdict.counted), bool(verdict.stop)


@pytest.mark.parametrize(
    "case, kwargs, expected",
    [
        ("a good step counts", {}, (True, 1, False)),
        ("bad gradients stop the loop", dict(update_bad=True), (False, 0, True)),
        ("a NaN metric stops the loop", dict(metrics=(NAN, 4.0)), (False, 0, True)),
        ("an Inf count stops the loop", dict(metrics=(1.0, float("inf"))), (False, 0, True)),
        ("skip: a bad step counts, its metrics do not", dict(update_bad=True, skip_nonfinite=True), (False, 1, False)),
        (
            "a loss above the bound is bad",
            dict(loss=tf.constant([9.0, 4.0]), loss_upper_bound=2.0),
            (False, 0, True),
        ),
        (
            "a loss at the bound is good",
            dict(loss=tf.constant([8.0, 4.0]), loss_upper_bound=2.0),
            (True, 1, False),
        ),
    ],
)
def test_step_verdict(case, kwargs, expected):
    assert _verdict(**kwargs) == expected, case


@pytest.mark.fast
def test_loop_options_come_from_the_flags():
    config = small_config(
        "unused",
        grad_accum_steps=2,
        on_nonfinite="skip",
        summaries="basic",
        histogram_every=5,
        loss_upper_bound=3.0,
        strategy="mirrored",
    )
    options = LoopOptions.from_config(config)
    assert (options.accum_steps, options.skip_nonfinite, options.update_summaries, options.gradients) == (
        2,
        True,
        False,
        True,
    )
    assert (options.loss_upper_bound, options.strategy_name, options.jit_compile) == (3.0, "mirrored", False)
    assert not LoopOptions.from_config(config.replace(on_nonfinite="rollback")).skip_nonfinite
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.accum_steps = 3


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_loop_counts_every_step_and_example_and_keeps_the_gradients(tmp_path, replicas):
    strategy = build_strategy("mirrored", replicas).strategy
    config = small_config(tmp_path, model="mlp", histogram_every=1)
    task = Task(config, input_shape=(28, 28, 1), num_classes=10)
    task.total_steps = 100
    state = create_state(strategy, task, seed=1, model_dir=str(tmp_path), is_chief=True, keep=1)
    images, labels = synthetic_arrays(512, seed=1)
    iterator = iter(strategy.experimental_distribute_dataset(train_dataset(images, labels, 64, seed=1)))
    loop = make_train_loop(strategy, task, state.global_step, LoopOptions.from_config(config))
    for num_steps, total in ((3, 3), (2, 5)):
        result = loop(iterator, tf.constant(num_steps))
        assert int(result["steps"]) == num_steps and int(state.global_step.numpy()) == total
        assert float(result["totals"]["loss"][1]) == num_steps * 64  # every example of every step
        assert (int(result["bad_steps"]), int(result["skipped_updates"])) == (0, 0)
    assert loop.experimental_get_tracing_count() == 1  # the step count is a tensor: one trace
    kept = result["gradients"]
    assert [g.shape for g in kept] == [v.shape for v in task.model.trainable_variables]
    assert all(np.isfinite(g.numpy()).all() for g in kept) and any(np.abs(g.numpy()).sum() > 0 for g in kept)
