"""--lr_schedule, --warmup_steps and --weight_decay (engine/optimizers.py), on real TensorFlow."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, exported_weights, small_config, tensorboard_scalars
from engine.errors import UserError
from engine.optimizers import build_optimizer
from engine.controller.trainer import train

RATE = 0.01


def expected_rate(step, schedule, total, warmup=0, rate=RATE):
    """The closed forms the flags' help promises, at optimizer step `step` (updates applied so far)."""
    step = min(step, total)
    if schedule == "constant":
        return rate
    if schedule == "cosine":
        return rate * 0.5 * (1 + math.cos(math.pi * step / total))
    if step < warmup:
        return rate * step / warmup
    return rate * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def _optimizer(total_steps=12, variables=None, **overrides):
    config = small_config("/unused", learning_rate=RATE, **overrides)
    optimizer = build_optimizer(config, total_steps)
    optimizer.build(variables or [tf.Variable([1.0])])
    return optimizer


def _rate_at(optimizer, step):
    """What the trainer logs: optimizer.learning_rate with optimizer.iterations == step."""
    optimizer.iterations.assign(step)
    return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())


@pytest.mark.parametrize("schedule, warmup", [("constant", 0), ("cosine", 0), ("warmup_cosine", 4)])
def test_schedule_values_match_the_closed_form(schedule, warmup):
    optimizer = _optimizer(total_steps=12, lr_schedule=schedule, warmup_steps=warmup)
    # 0, mid-warm-up, end of warm-up (the peak), mid-cosine, the last update, the end, past the end.
    for step in (0, 2, 4, 8, 11, 12, 15):
        assert _rate_at(optimizer, step) == pytest.approx(expected_rate(step, schedule, 12, warmup), abs=1e-9), step
    if schedule == "warmup_cosine":
        assert _rate_at(optimizer, 4) == pytest.approx(RATE) and _rate_at(optimizer, 8) == pytest.approx(RATE / 2)
    if schedule != "constant":
        assert _rate_at(optimizer, 12) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.fast
def test_default_rate_is_the_optimizers(tmp_path):
    config = small_config(tmp_path, optimizer="sgd", lr_schedule="cosine")
    optimizer = build_optimizer(config, 10)
    optimizer.build([tf.Variable([1.0])])
    assert _rate_at(optimizer, 0) == pytest.approx(0.05)


def _logged(logdir, tag):
    return dict(tensorboard_scalars(logdir)[tag])


def test_engine_logs_the_scheduled_rate(tmp_path):
    """learning_rate at step N in TensorBoard = rate(N), the rate of the next update; it rises
    during warm-up, then falls to 0 at the last step. A resumed run continues from its
    checkpointed optimizer.iterations (not from 0), here on 2 replicas (a MirroredVariable)."""
    first = small_config(
        tmp_path,
        model="mlp",
        learning_rate=RATE,
        lr_schedule="warmup_cosine",
        warmup_steps=4,
        train_steps=6,
        steps_per_loop=2,
    )
    train(first, **QUIET)
    # Resumes at 6, now on 2 replicas; the schedule now ends at 12.
    train(first.replace(train_steps=12, strategy="mirrored", cpu_replicas=2), **QUIET)
    logged = _logged(tmp_path / "train", "learning_rate")
    assert sorted(logged) == [2, 4, 6, 8, 10, 12]
    assert logged[2] < logged[4] > logged[8] > logged[10] > logged[12]
    for step in (2, 4):
        assert logged[step] == pytest.approx(expected_rate(step, "warmup_cosine", 6, 4), rel=1e-6)
    for step in (8, 10, 12):
        assert logged[step] == pytest.approx(expected_rate(step, "warmup_cosine", 12, 4), rel=1e-6, abs=1e-9)


def _tiny_model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, bias_initializer="ones"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2, bias_initializer="ones", name="bias_net"),  # a kernel, despite the name
        ]
    )


@pytest.mark.parametrize(
    "optimizer, schedule, step", [("adam", "constant", 0), ("sgd", "constant", 0), ("adam", "warmup_cosine", 6)]
)
def test_weight_decay_shrinks_kernels_only(optimizer, schedule, step):
    """Zero gradients: Adam/SGD move nothing, so what changes is the decay alone, w *= 1 - rate * W,
    at the scheduled rate of this step; biases and batch-norm gamma/beta are not decayed."""
    decay = 0.5
    model = _tiny_model()
    warmup = 4 if schedule == "warmup_cosine" else 0
    opt = _optimizer(
        total_steps=12,
        variables=model.trainable_variables,
        optimizer=optimizer,
        weight_decay=decay,
        lr_schedule=schedule,
        warmup_steps=warmup,
    )
    assert isinstance(opt, keras.optimizers.AdamW if optimizer == "adam" else keras.optimizers.SGD)
    rate = _rate_at(opt, step)
    assert rate > 0
    before = {v.path: v.numpy() for v in model.trainable_variables}
    opt.apply_gradients([(tf.zeros_like(v), v) for v in model.trainable_variables])
    for v in model.trainable_variables:
        factor = (1 - rate * decay) if v.name == "kernel" else 1.0
        np.testing.assert_allclose(v.numpy(), before[v.path] * factor, rtol=1e-6, err_msg=v.path)
    assert sorted(v.name for v in model.trainable_variables) == ["beta", "bias", "bias", "gamma", "kernel", "kernel"]


def _norms(weights):
    return [float(np.linalg.norm(w)) for w in weights]


def test_weight_decay_in_a_run_gives_smaller_kernels(tmp_path):
    def run(name, decay):
        train(small_config(tmp_path / name, model="mlp", learning_rate=RATE, weight_decay=decay, export=True), **QUIET)
        return exported_weights(tmp_path / name)  # mlp: kernel, bias, kernel, bias

    plain, decayed = run("plain", 0.0), run("decayed", 2.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(plain, decayed)) > 1e-4
    for index in (0, 2):  # kernels
        assert _norms(decayed)[index] < _norms(plain)[index]


def test_two_replicas_match_one_with_schedule_and_decay(tmp_path):
    settings = dict(
        model="mlp",
        optimizer="adam",
        learning_rate=RATE,
        lr_schedule="warmup_cosine",
        warmup_steps=2,
        weight_decay=0.5,
        export=True,
    )
    train(small_config(tmp_path / "one", strategy="default", **settings), **QUIET)
    train(small_config(tmp_path / "two", strategy="mirrored", cpu_replicas=2, **settings), **QUIET)
    one, two = exported_weights(tmp_path / "one"), exported_weights(tmp_path / "two")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, two)) < 1e-5


@pytest.mark.parametrize(
    "schedule, warmup, message",
    [
        ("constant", 3, "--warmup_steps=3 only applies to --lr_schedule=warmup_cosine"),
        ("cosine", 3, "--warmup_steps=3 only applies to --lr_schedule=warmup_cosine"),
        (
            "warmup_cosine",
            0,
            "--lr_schedule=warmup_cosine needs 0 < --warmup_steps < the run's 12 steps; got --warmup_steps=0",
        ),
        ("warmup_cosine", 12, "got --warmup_steps=12"),
    ],
)
def test_warmup_misuse_is_a_user_error(schedule, warmup, message):
    with pytest.raises(UserError, match=message.replace("+", r"\+")):
        build_optimizer(small_config("/unused", lr_schedule=schedule, warmup_steps=warmup), 12)


def test_engine_checks_warmup_against_the_runs_steps(tmp_path):
    with pytest.raises(UserError, match="the run's 6 steps; got --warmup_steps=6"):
        train(small_config(tmp_path, model="mlp", lr_schedule="warmup_cosine", warmup_steps=6), **QUIET)


def test_a_resumed_run_uses_its_own_learning_rate(tmp_path):
    """Keras keeps a constant rate in a variable the checkpoint restores; the new flag must win."""
    config = small_config(tmp_path, model="mlp", learning_rate=0.01, train_steps=3, steps_per_loop=3)
    train(config, **QUIET)
    train(config.replace(learning_rate=0.5, train_steps=6), **QUIET)
    rates = _logged(tmp_path / "train", "learning_rate")
    assert rates[3] == pytest.approx(0.01) and rates[6] == pytest.approx(0.5)
