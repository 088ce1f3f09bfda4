"""The built-in classifiers for small images. Each takes (input_shape, num_classes) and returns a
Keras model that outputs logits (no softmax: the loss works from logits, which is more stable)."""

from __future__ import annotations

import keras


def seed_cnn(input_shape, num_classes):
    """The Keras MNIST example's CNN: conv 32 3x3, max-pool, dense 128, dense `num_classes`."""
    return keras.Sequential(
        [
            keras.Input(shape=input_shape),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(num_classes, dtype="float32"),
        ],
        name="cnn",
    )


def mlp(input_shape, num_classes):
    """A small dense network: fast, for smoke tests and quick experiments."""
    return keras.Sequential(
        [
            keras.Input(shape=input_shape),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes, dtype="float32"),
        ],
        name="mlp",
    )


def cnn_bn(input_shape, num_classes, *, dropout=0.3, synchronized=True, momentum=0.9):
    """Two conv blocks with batch norm, for Fashion-MNIST (its measured accuracy: docs/models.md).

    [conv 32 3x3 same, no bias -> batch norm -> relu -> max-pool 2] -> [the same with 64 filters]
    -> flatten -> dropout -> dense 128 relu -> dropout -> dense `num_classes` (float32 logits).
    About 4.2 M multiply-adds per 28x28 example forward (the 64-filter conv is 85% of them), so
    roughly 25 MFLOP per trained example: 5x the seed CNN.

    `synchronized=True` makes batch norm use the statistics of the GLOBAL batch: each replica's
    sums are all-reduced (across workers too) inside the layer, so N replicas normalise, and update
    the moving mean/variance, exactly as one replica fed the whole batch. With False, each replica
    normalises by its own slice, and its copy of the moving statistics drifts from the others
    (Keras creates them with aggregation NONE); the checkpoint keeps only replica 0's copy.
    Under no strategy (or one replica) both settings compute the same thing.
    `dropout` is the rate of both dropout layers (0: none). `momentum` is batch norm's moving-average
    momentum: 0.9, not Keras's 0.99, because with a constant learning rate the weights move faster
    than a ~100-step average follows, and evaluation (which uses the moving statistics) suffered:
    at 0.99 recomputing the statistics over training images raised the test accuracy markedly, at
    0.9 barely (the runs: docs/models.md).
    """

    def block(filters, name):
        return [
            keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv"),
            keras.layers.BatchNormalization(synchronized=synchronized, momentum=momentum, name=f"{name}_bn"),
            keras.layers.ReLU(name=f"{name}_relu"),
            keras.layers.MaxPooling2D(2, name=f"{name}_pool"),
        ]

    return keras.Sequential(
        [
            keras.Input(shape=input_shape),
            *block(32, "block1"),
            *block(64, "block2"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dropout(dropout, name="dropout1"),
            keras.layers.Dense(128, activation="relu", name="dense"),
            keras.layers.Dropout(dropout, name="dropout2"),
            keras.layers.Dense(num_classes, dtype="float32", name="logits"),
        ],
        name="cnn_bn",  # every layer named: weight paths are the same in every build
    )
