"""Checkpoints: a run resumed from its model_dir continues the global step and optimizer state."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from helpers import QUIET, exported_weights, small_config

from engine.controller.trainer import train


def _checkpoint_values(model_dir):
    latest = tf.train.latest_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    reader = tf.train.load_checkpoint(latest)
    names = dict(tf.train.list_variables(latest))
    return {
        "global_step": int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE")),
        "iterations": int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")),
        "epoch": int(reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE")),
        "names": names,
    }


def test_resume_continues_step_and_optimizer(tmp_path):
    config = small_config(tmp_path / "resumed", optimizer="adam", export=True, train_steps=4, steps_per_loop=2)
    first = train(config, **QUIET)
    assert first.final_step == 4 and _checkpoint_values(tmp_path / "resumed")["iterations"] == 4
    second = train(config.replace(train_steps=20), **QUIET)
    assert second.start_step == 4 and second.final_step == 20
    values = _checkpoint_values(tmp_path / "resumed")
    assert values["global_step"] == 20 and values["iterations"] == 20
    assert values["epoch"] == 1  # 16 steps per epoch (1024 examples / 64)
    assert any(name.startswith("optimizer/_variables") for name in values["names"])  # Adam moments

    straight = train(config.replace(model_dir=str(tmp_path / "straight"), train_steps=20), **QUIET)
    assert straight.start_step == 0
    for resumed, uninterrupted in zip(exported_weights(tmp_path / "resumed"), exported_weights(tmp_path / "straight")):
        np.testing.assert_allclose(resumed, uninterrupted, atol=1e-5)


def test_finished_run_trains_nothing_more(tmp_path):
    config = small_config(tmp_path, train_steps=3)
    train(config, **QUIET)
    again = train(config, **QUIET)
    assert again.start_step == again.final_step == 3 and "accuracy" in again.eval_metrics


def test_resume_without_seed_keeps_the_runs_seed_and_data_order(tmp_path):
    config = small_config(tmp_path / "resumed", seed=None, export=True, train_steps=3)
    train(config, **QUIET)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / "resumed" / "checkpoints")))
    seed = int(reader.get_tensor("seed/.ATTRIBUTES/VARIABLE_VALUE"))
    train(config.replace(train_steps=8), **QUIET)
    train(config.replace(model_dir=str(tmp_path / "straight"), seed=seed, train_steps=8), **QUIET)
    for a, b in zip(exported_weights(tmp_path / "resumed"), exported_weights(tmp_path / "straight")):
        np.testing.assert_allclose(a, b, atol=1e-5)
