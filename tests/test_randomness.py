"""Random ops differ per replica (Keras' mirrored seed state would give every replica the same
Dropout mask), yet a seeded run repeats, and one replica draws exactly what Keras draws."""

from __future__ import annotations


import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, TASKS_EQUIVALENCE, exported_weights, max_difference, small_config
from engine.randomness import per_replica_randomness, replica_seed, seed_generators
from engine.distribute.strategy import build_strategy
from engine.task import Task
from engine.controller.trainer import train

WIDTH = 256  # an all-ones input this wide: two equal 0.5-dropout masks by chance, 2**-256


def _strategy(replicas):
    return build_strategy("mirrored", replicas).strategy


def _dropout_model(seed=None):
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dropout(0.5, seed=seed)])


def _per_replica(strategy, fn, calls=2):
    """[[replica 0's fn() output, replica 1's, ...] for each of `calls` calls of a tf.function]."""
    step = tf.function(lambda: strategy.run(fn))
    return [[v.numpy() for v in strategy.experimental_local_results(step())] for _ in range(calls)]


def _dropout_masks(strategy, model, calls=2):
    return _per_replica(strategy, lambda: model(tf.ones((1, WIDTH)), training=True), calls)


def test_dropout_masks_differ_per_replica_only_with_the_wrapper():
    strategy = _strategy(2)
    with strategy.scope():
        plain, wrapped = _dropout_model(seed=11), _dropout_model(seed=11)
    assert per_replica_randomness(wrapped) == 1
    plain_masks, wrapped_masks = _dropout_masks(strategy, plain), _dropout_masks(strategy, wrapped)
    for (p0, p1), (w0, w1) in zip(plain_masks, wrapped_masks):
        assert np.array_equal(p0, p1), "Keras alone: the same mask on both replicas (the trap)"
        assert not np.array_equal(w0, w1), "wrapped: each replica its own mask"
        np.testing.assert_array_equal(w0, p0)  # replica 0 keeps Keras' own draw
    assert not np.array_equal(wrapped_masks[0][1], wrapped_masks[1][1]), "a new mask each call"
    # The mirrored state advanced once per call, identically on both replicas.
    states = [v.numpy() for v in strategy.experimental_local_results(seed_generators(wrapped)[0].state.value)]
    np.testing.assert_array_equal(states[0], [11, 2])
    np.testing.assert_array_equal(states[1], [11, 2])


def test_task_random_seed_differs_per_replica_and_step():
    strategy = _strategy(2)
    task = Task(small_config("unused"), input_shape=(4,), num_classes=2)
    with pytest.raises(ValueError, match="Task.seed"):
        task.random_seed()  # not set yet: the engine sets it
    task.seed = 3
    with strategy.scope():
        task.global_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
        )

    def draws():
        def draw(salt):
            return _per_replica(
                strategy, lambda: tf.random.stateless_uniform([WIDTH], seed=task.random_seed(salt)), calls=1
            )[0]

        return [draw(0), draw(1)]

    (a0, a1), (b0, _) = draws()  # salt 0, salt 1 at step 0
    assert not np.array_equal(a0, a1), "replicas differ"
    assert not np.array_equal(a0, b0), "salts differ"
    again = draws()
    np.testing.assert_array_equal(again[0][0], a0)  # same seed, step, salt, replica: same draw
    np.testing.assert_array_equal(again[0][1], a1)
    task.global_step.assign(1)
    (c0, c1), _ = draws()
    assert not np.array_equal(c0, a0) and not np.array_equal(c1, a1), "steps differ"
    task.seed = 4
    (d0, _), _ = draws()
    assert not np.array_equal(d0, c0), "seeds differ"
    seed = replica_seed(2**40 + 5, tf.constant(2**33, tf.int64), salt=7)  # large values stay valid
    assert seed.dtype == tf.int32 and seed.shape == (2,)


def test_one_replica_draws_exactly_what_keras_draws():
    for strategy in (_strategy(1), tf.distribute.get_strategy()):
        with strategy.scope():
            plain, wrapped = _dropout_model(seed=5), _dropout_model(seed=5)
        per_replica_randomness(wrapped)
        for (p,), (w,) in zip(_dropout_masks(strategy, plain, 3), _dropout_masks(strategy, wrapped, 3)):
            np.testing.assert_array_equal(w, p)
    # Eager, no strategy, and the raw seeds: identical values and dtype.
    plain, wrapped = _dropout_model(seed=9), _dropout_model(seed=9)
    per_replica_randomness(wrapped)
    for _ in range(3):
        p, w = seed_generators(plain)[0].next(), seed_generators(wrapped)[0].next()
        assert w.dtype == p.dtype
        np.testing.assert_array_equal(w.numpy(), p.numpy())


@pytest.mark.fast
def test_wrapping_is_idempotent_and_reaches_nested_layers():
    strategy = _strategy(2)
    with strategy.scope():
        inner = keras.Sequential([keras.Input((WIDTH,)), keras.layers.GaussianNoise(1.0, seed=1)])
        model = keras.Sequential([keras.Input((WIDTH,)), inner, keras.layers.Dropout(0.5, seed=2)])
        twice = keras.Sequential([keras.Input((WIDTH,)), keras.layers.GaussianNoise(1.0, seed=1)])
    assert per_replica_randomness(model) == 2  # the nested GaussianNoise and the Dropout
    assert per_replica_randomness(model) == 0

    def noise(model):
        return _per_replica(strategy, lambda: model(tf.zeros((1, WIDTH)), training=True), calls=1)[0]

    once_draws = noise(inner)  # inner was wrapped once, through model
    per_replica_randomness(twice)
    per_replica_randomness(twice)
    twice_draws = noise(twice)  # same seed, wrapped twice: no double fold
    assert not np.array_equal(*once_draws)
    np.testing.assert_array_equal(twice_draws[0], once_draws[0])
    np.testing.assert_array_equal(twice_draws[1], once_draws[1])


def _trained(tmp_path, name, **overrides):
    model_dir = tmp_path / name
    config = small_config(
        model_dir,
        model="mlp",
        task=f"{TASKS_EQUIVALENCE}:DropoutTask",
        strategy="mirrored",
        cpu_replicas=2,
        optimizer="sgd",
        learning_rate=0.1,
        export=True,
        synthetic_train_examples=256,
        synthetic_test_examples=64,
        train_steps=4,
        steps_per_loop=2,
        **overrides,
    )
    train(config, **QUIET)
    return exported_weights(model_dir)


def test_seeded_runs_with_dropout_repeat(tmp_path, monkeypatch):
    """Two runs with --seed=3 (Dropout and Task.random_seed noise on 2 replicas) train the same
    weights (bitwise here; allclose allows for summation order); --seed=4 trains others."""
    first, second = _trained(tmp_path, "a", seed=3), _trained(tmp_path, "b", seed=3)
    for x, y in zip(first, second):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    assert max_difference(first, _trained(tmp_path, "c", seed=4)) > 1e-3
    # The trainer applies the wrapper: without it (one Dropout mask for both replicas) the same
    # seed trains other weights.
    monkeypatch.setattr("engine.controller.state.per_replica_randomness", lambda model: 0)
    assert max_difference(first, _trained(tmp_path, "unwrapped", seed=3)) > 1e-3
