"""--ema_decay: the moving average of the weights is updated inside the compiled step, checkpointed
(exact on resume), the same for N replicas as for one, evaluated next to the trained weights
(eval_ema/), and what best/ and the export hold."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import QUIET, checkpoint_state, exported_weights, small_config, tensorboard_scalars

from engine.controller.trainer import train
from engine.ema import WeightAverage

TWO = dict(strategy="mirrored", cpu_replicas=2)


def _config(tmp_path, name="run", **overrides):
    return small_config(tmp_path / name, **{"model": "mlp", "ema_decay": 0.9, **overrides})


def _averages(model_dir) -> dict:
    return checkpoint_state(model_dir, prefixes=("ema/", "ema_updates/"))


@pytest.mark.fast
def test_the_average_follows_the_documented_warm_up():
    strategy = tf.distribute.get_strategy()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    start = model.get_weights()[0]
    average = WeightAverage(model, decay=0.9)
    expected = start.copy()
    for t in range(4):
        weights = np.full_like(start, float(t + 1))
        model.set_weights([weights])
        average.update(strategy)
        d = min(0.9, (1 + t) / (10 + t))  # 0.1, 0.18, 0.25, 0.31: the warm-up, then 0.9
        expected = d * expected + (1 - d) * weights
    np.testing.assert_allclose(average.averages[0].numpy(), expected, rtol=1e-6)
    with average.swapped():
        np.testing.assert_allclose(model.get_weights()[0], expected, rtol=1e-6)
    np.testing.assert_array_equal(model.get_weights()[0], np.full_like(start, 4.0))


def test_the_averages_are_checkpointed_and_evaluated_next_to_the_weights(tmp_path):
    result = train(_config(tmp_path), **QUIET)
    averages = _averages(tmp_path / "run")
    assert int(next(v for k, v in averages.items() if k.startswith("ema_updates/"))) == 6
    assert len([k for k in averages if k.startswith("ema/")]) == 4  # kernel and bias of 2 layers
    ema_eval = tensorboard_scalars(tmp_path / "run" / "eval_ema")
    raw_eval = tensorboard_scalars(tmp_path / "run" / "eval")
    assert [s for s, _ in ema_eval["accuracy"]] == [s for s, _ in raw_eval["accuracy"]] == [6]
    assert ema_eval["loss"][0][1] != raw_eval["loss"][0][1]
    assert result.eval_metrics  # the raw weights' metrics stay the run's result


def test_a_resumed_run_continues_the_averages_exactly(tmp_path):
    train(_config(tmp_path, "resumed"), **QUIET)
    train(_config(tmp_path, "resumed", train_steps=12), **QUIET)
    train(_config(tmp_path, "straight", train_steps=12), **QUIET)
    resumed, straight = _averages(tmp_path / "resumed"), _averages(tmp_path / "straight")
    assert resumed.keys() == straight.keys()
    for name in resumed:
        np.testing.assert_allclose(resumed[name], straight[name], atol=1e-6, err_msg=name)


def test_two_replicas_average_like_one(tmp_path):
    train(_config(tmp_path, "two", **TWO), **QUIET)
    train(_config(tmp_path, "one", strategy="default"), **QUIET)
    two, one = _averages(tmp_path / "two"), _averages(tmp_path / "one")
    for name in one:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, err_msg=name)


def test_the_export_and_best_hold_the_ema_weights(tmp_path):
    train(_config(tmp_path, export=True, best_metric="accuracy"), **QUIET)
    averages = _averages(tmp_path / "run")
    ema = [averages[k] for k in sorted(k for k in averages if k.startswith("ema/"))]
    exported = exported_weights(tmp_path / "run")
    best = [np.asarray(w) for w in keras.models.load_model(tmp_path / "run" / "best" / "model.keras").weights]
    key = lambda a: (a.shape, float(np.sum(a)))  # noqa: E731 - match arrays regardless of order
    assert sorted(map(key, exported)) == sorted(map(key, ema))
    assert sorted(map(key, best)) == sorted(map(key, ema))
