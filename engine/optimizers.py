"""Optimizer registry and the learning-rate schedule / weight decay flags.

`build_optimizer(config, total_steps)` -> an unbuilt Keras optimizer:
  * `--optimizer` name -> class, with a per-optimizer default `--learning_rate`;
  * `--lr_schedule`: the rate at optimizer step s (s = optimizer.iterations, the number of updates
    applied so far, checkpointed, so a resumed run continues the schedule; update s+1 uses rate(s)):
      constant       rate
      cosine         rate * (1 + cos(pi * min(s, T) / T)) / 2                      T = total_steps
      warmup_cosine  rate * s / W                                  for s < W,      W = warmup_steps
                     rate * (1 + cos(pi * (min(s, T) - W) / (T - W))) / 2   for s >= W
    (so warm-up's first update has rate 0, and rate(T), logged at the run's end, is 0);
  * `--weight_decay=W > 0`: Keras' decoupled decay, w -= rate(s) * W * w before each update (AdamW
    for adam), on every trainable variable except biases and normalization scales/offsets.
"""

from __future__ import annotations

import math

import keras

from engine import compat
from engine.errors import UserError

# name -> (class, class with decoupled weight decay, default learning rate)
OPTIMIZERS = {
    "adam": (keras.optimizers.Adam, keras.optimizers.AdamW, 1e-3),
    "sgd": (keras.optimizers.SGD, keras.optimizers.SGD, 0.05),
}

# Not decayed: biases and (batch/layer/group) normalization gamma/beta. Keras matches this regex
# with re.search against the TF variable's name, which is the full path ("sequential/dense/bias:0"),
# so it is anchored to the last path component: a layer called "bias_net" keeps its kernel decayed.
NO_DECAY = r"(?:^|/)(?:bias|gamma|beta)(?::\d+)?$"


def learning_rate_schedule(config, total_steps: int | None, rate: float):
    """The learning rate as `--lr_schedule` says: a float, or a Keras schedule of optimizer steps."""
    schedule, warmup = config.lr_schedule, config.warmup_steps
    if warmup and schedule != "warmup_cosine":
        raise UserError(
            f"--warmup_steps={warmup} only applies to --lr_schedule=warmup_cosine "
            f"(this run has --lr_schedule={schedule}); drop it or set --lr_schedule=warmup_cosine"
        )
    if schedule == "constant":
        return rate
    if total_steps is None:
        raise ValueError("Task.total_steps must be set before build_optimizer() for a learning-rate schedule")
    if schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(rate, decay_steps=total_steps)
    if schedule == "warmup_cosine":
        if not 0 < warmup < total_steps:
            raise UserError(
                f"--lr_schedule=warmup_cosine needs 0 < --warmup_steps < the run's {total_steps} "
                f"steps; got --warmup_steps={warmup}"
            )
        # Keras' CosineDecay warms up linearly from its FIRST argument to warmup_target over
        # warmup_steps, THEN decays over decay_steps more: the run ends at warmup + decay steps.
        return keras.optimizers.schedules.CosineDecay(
            0.0, decay_steps=total_steps - warmup, warmup_target=rate, warmup_steps=warmup
        )
    raise UserError(f"unknown --lr_schedule={schedule!r}; valid: constant, cosine, warmup_cosine")


def build_optimizer(config, total_steps: int | None) -> keras.optimizers.Optimizer:
    """The `--optimizer` for a run of `total_steps` optimizer updates (None: unknown, constant rate only)."""
    if config.optimizer not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer={config.optimizer!r}; valid: {', '.join(sorted(OPTIMIZERS))}")
    plain, decoupled, default_rate = OPTIMIZERS[config.optimizer]
    rate = default_rate if config.learning_rate is None else config.learning_rate
    learning_rate = learning_rate_schedule(config, total_steps, rate)
    decay = config.weight_decay
    if not (math.isfinite(decay) and decay >= 0):
        raise UserError(f"--weight_decay must be a finite number >= 0; got --weight_decay={decay}")
    if not decay:
        return plain(learning_rate=learning_rate)
    optimizer = decoupled(learning_rate=learning_rate, weight_decay=decay)
    optimizer.exclude_from_weight_decay(var_names=[NO_DECAY])  # before build, or Keras refuses
    return optimizer


def constant_rate(optimizer) -> float | None:
    """The optimizer's learning rate when it is a constant (Keras keeps it in a variable, which a
    checkpoint restores); None when it follows a schedule."""
    rate = compat.optimizer_learning_rate(optimizer)
    if rate is None or isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(keras.ops.convert_to_numpy(rate))
