"""Model registry. Each builder takes (input_shape, num_classes) and returns a Keras model that
outputs logits (no softmax: the loss works from logits, which is more stable)."""

from __future__ import annotations

import keras

from engine.errors import UserError


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


MODELS = {"cnn": seed_cnn, "mlp": mlp}


def build_model(name: str, input_shape, num_classes: int) -> keras.Model:
    if name not in MODELS:
        raise UserError(f"unknown --model={name!r}; valid: {', '.join(sorted(MODELS))}")
    return MODELS[name](input_shape, num_classes)
