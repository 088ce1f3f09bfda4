"""The model registry's cnn_bn: its shape, that it learns, and that its batch norm is synchronised
across replicas (N replicas train like one replica fed the same global batch, BN moving statistics
included)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import (
    NO_DROPOUT,
    TASKS_EQUIVALENCE,
    exported_by_name,
    max_difference,
    run_cli,
    small_flags,
    trained_by_name,
)
from engine.data.builtin import synthetic_arrays
from engine.models.registry import build_model
from engine.distribute.strategy import build_strategy

NO_DROPOUT_UNSYNCED = f"{TASKS_EQUIVALENCE}:UnsyncedCnnBnNoDropoutTask"  # the same, BN synchronized=False


def _train(model_dir, **overrides) -> dict:
    """Two SGD steps. Longer runs of a freshly initialised BN network amplify float rounding (the
    replicas sum in a different order): after 6 steps synchronised 2-vs-1 replica weights differ by
    up to ~3e-4, after 1-2 steps by ~1e-6, while unsynchronised statistics differ by 1e-3 and more."""
    return trained_by_name(
        model_dir, **{**dict(model="cnn_bn", optimizer="sgd", train_steps=2, steps_per_loop=2), **overrides}
    )


# ---- the model itself ----


@pytest.mark.fast
def test_cnn_bn_shape_dtype_and_parameters():
    model = build_model("cnn_bn", (28, 28, 1), 10)
    logits = model(tf.zeros([3, 28, 28, 1]), training=False)
    assert logits.shape == (3, 10) and logits.dtype == tf.float32
    # conv 3*3*1*32 + conv 3*3*32*64 (no biases) + dense 3136*128+128 + dense 128*10+10 + BN 4*(32+64).
    assert model.count_params() == 288 + 18_432 + 401_536 + 1_290 + 4 * 96 == 421_930
    non_trainable = sorted(w.path for w in model.non_trainable_weights)
    assert non_trainable == sorted(
        f"cnn_bn/block{b}_bn/{s}" for b in (1, 2) for s in ("moving_mean", "moving_variance")
    )
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 2 and all(layer.synchronized for layer in norms)


def test_cnn_bn_learns_synthetic_data():
    """Fits a fixed synthetic batch (dropout on, training mode). Evaluation after a few steps would
    prove little: inference uses the moving statistics, which at momentum 0.99 need a few hundred
    steps to catch up, so a short run evaluates at chance level while its training loss falls."""
    images, labels = synthetic_arrays(64, seed=3)
    images = tf.constant(images[..., None] / 255.0, tf.float32)
    keras.utils.set_random_seed(3)
    model = build_model("cnn_bn", (28, 28, 1), 10)
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, model(images, training=True), from_logits=True)
            )
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    losses = [float(step()) for _ in range(40)]
    assert np.mean(losses[-5:]) < min(0.25, 0.1 * losses[0]), losses
    assert np.abs(model.get_layer("block1_bn").moving_mean.numpy()).max() > 0  # training mode updates them


# ---- batch-norm synchronisation ----


@pytest.mark.parametrize("synchronized", [True, False])
@pytest.mark.fast
def test_bn_layer_statistics_across_replicas(synchronized):
    """Directly: each replica's copy of the moving mean after one training-mode call on 2 replicas.
    Keras creates the moving statistics with aggregation NONE, so without synchronisation each
    replica writes its own slice's mean into its own copy, and the copies silently differ."""
    images = tf.reshape(tf.range(2 * 4 * 3, dtype=tf.float32), [8, 3])  # replica 1's half is larger
    whole_batch_mean = tf.reduce_mean(images, axis=0).numpy()
    strategy = build_strategy("mirrored", 2).strategy  # the engine's (not collective all-reduce)
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=0.0, synchronized=synchronized)
        layer.build((None, 3))
    halves = strategy.experimental_distribute_values_from_function(
        lambda context: images[4 * context.replica_id_in_sync_group :][:4]
    )
    strategy.run(tf.function(lambda x: layer(x, training=True)), args=(halves,))
    copies = [v.numpy() for v in layer.moving_mean.value.values]  # one per replica
    if synchronized:
        for copy in copies:
            np.testing.assert_allclose(copy, whole_batch_mean, rtol=1e-6)
    else:
        np.testing.assert_allclose(copies[0], tf.reduce_mean(images[:4], axis=0).numpy(), rtol=1e-6)
        np.testing.assert_allclose(copies[1], tf.reduce_mean(images[4:], axis=0).numpy(), rtol=1e-6)

    # Without a strategy the synchronised layer falls back to the whole (only) batch.
    plain = keras.layers.BatchNormalization(momentum=0.0, synchronized=synchronized)
    plain(images, training=True)
    np.testing.assert_allclose(plain.moving_mean.numpy(), whole_batch_mean, rtol=1e-6)


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    """cnn_bn without dropout, trained a few steps on no strategy (the reference)."""
    return _train(tmp_path_factory.mktemp("one_replica"), task=NO_DROPOUT, strategy="default")


def test_synchronized_bn_two_replicas_train_like_one(tmp_path, one_replica):
    two = _train(tmp_path, task=NO_DROPOUT, strategy="mirrored", cpu_replicas=2)
    moved = max(float(np.max(np.abs(w))) for n, w in one_replica.items() if n.endswith("moving_mean"))
    assert moved > 0.03, "the moving statistics must have moved from their initial 0 (mean)"
    assert max_difference(one_replica, two) < 1e-5  # every weight, BN moving mean/variance included


def test_unsynchronized_bn_two_replicas_drift(tmp_path, one_replica):
    """The same comparison fails with synchronized=False: so the test above would catch a regression."""
    unsynced_one = _train(tmp_path / "one", task=NO_DROPOUT_UNSYNCED, strategy="default")
    unsynced_two = _train(tmp_path / "two", task=NO_DROPOUT_UNSYNCED, strategy="mirrored", cpu_replicas=2)
    assert max_difference(unsynced_one, one_replica) < 1e-5  # one replica: the flag changes nothing
    assert max_difference(unsynced_one, unsynced_two, moving_only=True) > 3e-4


@pytest.mark.cluster
def test_synchronized_bn_two_workers_train_like_one(tmp_path, one_replica):
    """MultiWorkerMirroredStrategy: 2 worker processes x 1 replica match the one-replica run."""
    launched = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--collective_timeout=30",
        *small_flags(train_steps=2, steps_per_loop=2, model="cnn_bn", optimizer="sgd"),
        f"--task={NO_DROPOUT}",
        f"--model_dir={tmp_path}",
        "--export",
        timeout=180,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "global batch 64 = 2 replicas x 32" in launched.stdout
    assert max_difference(one_replica, exported_by_name(tmp_path)) < 1e-5
