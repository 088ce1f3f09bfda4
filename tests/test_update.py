"""The engine's optimizer update (engine/update.py): mixed precision with an all-replica overflow
check, gradient accumulation, clipping after the cross-replica sum. Each test compares against a
run that must give the same (or a provably different) result, so a broken feature fails it."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from helpers import (
    QUIET,
    TASKS_NONFINITE,
    TASKS_REFUSED,
    checkpoint_state,
    exported_weights,
    small_config,
    tensorboard_scalars,
)
from engine.errors import UserError
from engine.controller.trainer import train
from engine.update import INITIAL_LOSS_SCALE

TWO_REPLICAS = dict(strategy="mirrored", cpu_replicas=2)


def _weights(tmp_path, name, **overrides):
    train(small_config(tmp_path / name, export=True, model="mlp", **overrides), **QUIET)
    return exported_weights(tmp_path / name)


def _assert_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=atol)


def test_float16_overflow_on_one_replica_skips_the_step_everywhere(tmp_path):
    """+Inf in replica 1's gradients only (replica 0 is clean) at step 3: the update is skipped on
    both replicas, the weights stay finite, the loss scale halves and the run goes on."""
    result = train(
        small_config(
            tmp_path / "inf",
            model="mlp",
            precision="mixed_float16",
            train_steps=6,
            steps_per_loop=3,
            task=f"{TASKS_NONFINITE}:InfGradientTask",
            **TWO_REPLICAS,
        ),
        **QUIET,
    )
    assert result.final_step == 6 and result.skipped_steps == 0  # an overflow is not a bad step
    state = checkpoint_state(tmp_path / "inf")
    assert all(np.all(np.isfinite(v)) for v in state.values())
    assert int(state["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 5  # 6 steps, 1 update skipped
    scalars = tensorboard_scalars(tmp_path / "inf" / "train")
    assert scalars["loss_scale"] == [(3, INITIAL_LOSS_SCALE / 2), (6, INITIAL_LOSS_SCALE / 2)]
    assert scalars["skipped_updates"] == [(3, 1.0), (6, 0.0)]


def test_float16_trains_like_float32_and_restores_the_policy(tmp_path):
    half = _weights(tmp_path, "half", precision="mixed_float16", **TWO_REPLICAS)
    full = _weights(tmp_path, "full", **TWO_REPLICAS)
    _assert_close(half, full, atol=2e-2)  # float16 compute, float32 weights: close, not equal
    assert keras.mixed_precision.dtype_policy().name == "float32"


def test_bfloat16_computes_in_bfloat16_with_a_float32_head(tmp_path):
    half = train(
        small_config(
            tmp_path / "half", model="mlp", precision="mixed_bfloat16", export=True, train_steps=20, steps_per_loop=10
        ),
        **QUIET,
    ).eval_metrics["loss"]
    full = train(small_config(tmp_path / "full", model="mlp", train_steps=20, steps_per_loop=10), **QUIET).eval_metrics[
        "loss"
    ]
    assert half < 2.28 and abs(half - full) < 0.01  # it learns (ln 10 = 2.30 at the start), like float32
    model = keras.models.load_model(os.path.join(str(tmp_path / "half"), "export", "model.keras"))
    assert model.layers[0].compute_dtype == "bfloat16" and model.layers[0].variable_dtype == "float32"
    assert model.layers[-1].compute_dtype == "float32"


def test_float16_refuses_a_step_that_does_not_scale_its_loss(tmp_path):
    with pytest.raises(UserError, match="self.scale_loss"):
        train(
            small_config(tmp_path, model="mlp", precision="mixed_float16", task=f"{TASKS_REFUSED}:UnscaledLossTask"),
            **QUIET,
        )


@pytest.mark.parametrize("strategy", [dict(strategy="default"), TWO_REPLICAS], ids=["one_replica", "two_replicas"])
def test_accumulating_micro_batches_gives_the_update_of_the_whole_batch(tmp_path, strategy):
    """4 micro-batches of 16 (8 per replica) summed == one step of the global batch 64."""
    whole = _weights(tmp_path, "whole", **strategy)
    accumulated = _weights(tmp_path, "accumulated", grad_accum_steps=4, **strategy)
    _assert_close(accumulated, whole)
    assert not np.allclose(whole[0], _weights(tmp_path, "smaller", global_batch=16, **strategy)[0], atol=1e-3)


def test_accumulation_needs_equal_micro_batches(tmp_path):
    with pytest.raises(UserError, match="not divisible by the 2 replicas x 3 micro-batches"):
        train(small_config(tmp_path, grad_accum_steps=3, **TWO_REPLICAS), **QUIET)


def test_accumulation_compiles_with_xla(tmp_path):
    _assert_close(
        _weights(tmp_path, "xla", grad_accum_steps=2, jit_compile=True, train_steps=3),
        _weights(tmp_path, "plain", train_steps=3),
        atol=1e-4,
    )


def test_clipping_uses_the_norm_of_the_summed_gradient(tmp_path):
    """Clipped on 2 replicas == clipped on 1: per-replica clipping (Keras' global_clipnorm under
    MirroredStrategy) would clip partial sums with their own, different norms."""
    clip = dict(clip_norm=0.05, optimizer="sgd")
    two = _weights(tmp_path, "two", **clip, **TWO_REPLICAS)
    one = _weights(tmp_path, "one", **clip)
    _assert_close(two, one)
    assert not np.allclose(one[0], _weights(tmp_path, "unclipped", optimizer="sgd")[0], atol=1e-4)
    norms = [value for _, value in tensorboard_scalars(tmp_path / "two" / "train")["grad_norm"]]
    assert min(norms) > 0.05  # it did clip: the logged norm is the one before clipping


@pytest.mark.parametrize("overrides", [dict(model="cnn_bn", **TWO_REPLICAS), dict(ema_decay=0.9)])
def test_the_update_beside_the_finite_check_trains_like_the_guarded_one(tmp_path, overrides):
    """--on_nonfinite=stop applies the update without waiting for the finite check (engine/update.py,
    unguarded); skip waits for it. On clean data both give the same weights, batch-norm statistics,
    optimizer state and weight averages."""
    for mode in ("stop", "skip"):
        train(small_config(tmp_path / mode, on_nonfinite=mode, train_steps=4, steps_per_loop=2, **overrides), **QUIET)
    stop, skip = checkpoint_state(tmp_path / "stop"), checkpoint_state(tmp_path / "skip")
    assert sorted(stop) == sorted(skip)
    for name in stop:
        np.testing.assert_allclose(stop[name], skip[name], atol=1e-6, err_msg=name)


@pytest.mark.fast
def test_only_stop_without_loss_scaling_updates_unguarded():
    from engine.update import Updater

    optimizer = keras.optimizers.SGD()
    assert not Updater(optimizer, loss_scaling=False, guarded=False).guarded
    assert Updater(optimizer, loss_scaling=True, guarded=False).guarded  # an overflow must be skipped
    assert Updater(optimizer, loss_scaling=False).guarded
