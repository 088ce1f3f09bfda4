"""Exponential moving average of the model's weights (--ema_decay).

After every applied update, inside the compiled step, each EMA variable moves towards its weight:

    ema = d * ema + (1 - d) * weight,   d = min(ema_decay, (1 + t) / (10 + t))

where t is the number of updates applied before this one (the warm-up keeps the first averages
from being dominated by the random initial weights: d is 0.1 at the first update, 0.5 at the
8th, and reaches 0.999 after about 9,000). The update runs in the engine's cross-replica update
(engine/update.py) with `strategy.extended.update`, so every replica averages its own copy of the
(identical) weights: no collective. A skipped (non-finite) step leaves the averages untouched.

The averages are checkpointed (a resumed run continues them exactly). `swapped()` puts them into
the model for an evaluation or an export and puts the trained weights back afterwards. The
model's non-trainable state (batch-norm statistics) is not averaged: the EMA weights are
evaluated with the model's current statistics.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

WARMUP = 10.0  # d = min(decay, (1 + t) / (WARMUP + t))


class WeightAverage:
    """Create inside strategy.scope(): one average per trainable variable of `model`."""

    def __init__(self, model, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.weights = list(model.trainable_variables)
        self.averages = [
            tf.Variable(
                w.value if hasattr(w, "value") else w,
                trainable=False,
                name="ema/" + w.path.replace("/", "_").replace(":", "_"),
            )
            for w in self.weights
        ]
        self.updates = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="ema/updates",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    def checkpoint_items(self) -> dict:
        return {"ema": list(self.averages), "ema_updates": self.updates}

    def start_from_weights(self) -> None:
        """The averages restart from the model's current weights (a resume that adds --ema_decay to
        a checkpoint without averages: from the restored weights, not the initial ones)."""
        for average, weight in zip(self.averages, self.weights):
            average.assign(getattr(weight, "value", weight))
        self.updates.assign(0)

    def update(self, strategy) -> None:
        """Cross-replica context, after the optimizer stepped: every replica's averages move."""
        t = tf.cast(self.updates, tf.float32)
        decay = tf.minimum(tf.constant(self.decay, tf.float32), (1.0 + t) / (WARMUP + t))
        for average, weight in zip(self.averages, self.weights):
            strategy.extended.update(average, _move, args=(getattr(weight, "value", weight), decay), group=False)
        self.updates.assign_add(1)

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the averages inside the block, its trained weights again after it (host side)."""
        trained = [tf.identity(w) for w in self.weights]
        for weight, average in zip(self.weights, self.averages):
            weight.assign(average)
        try:
            yield
        finally:
            for weight, value in zip(self.weights, trained):
                weight.assign(value)


def _move(average, weight, decay):
    return average.assign(decay * average + (1.0 - decay) * tf.cast(weight, average.dtype))
