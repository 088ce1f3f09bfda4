"""Optimizer registry: `--optimizer` name -> Keras optimizer, with a per-optimizer default rate."""

from __future__ import annotations

import keras

from engine.errors import UserError

# name -> (class, default learning rate)
OPTIMIZERS = {
    "adam": (keras.optimizers.Adam, 1e-3),
    "sgd": (keras.optimizers.SGD, 0.05),
}


def build_optimizer(name: str, learning_rate: float | None) -> keras.optimizers.Optimizer:
    if name not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer={name!r}; valid: {', '.join(sorted(OPTIMIZERS))}")
    cls, default_rate = OPTIMIZERS[name]
    return cls(learning_rate=default_rate if learning_rate is None else learning_rate)
