"""The optimizer update, owned by the engine: what happens to a replica's gradients after the
Task's train_step hands them over with `Task.apply_gradients`.

In replica context, once per step (after all micro-batches of a global batch):

  1. ONE all-reduce (SUM) of the gradients over every replica and worker (invariant 4: Keras'
     own all-reduce inside `apply` is switched off for this call, never doubled);
  2. unscale (dynamic loss scaling, --precision=mixed_float16);
  3. finite check of the SUMMED gradients: an Inf/NaN on any replica makes the sum non-finite on
     every replica, so all replicas and workers decide alike with no extra collective
     (invariant 5), unlike Keras' LossScaleOptimizer, which checks the local gradients only;
  4. global-norm clipping (--clip_norm) of the summed gradients, so the norm is the true one;
  5. the Keras optimizer update (weight decay included) inside a cond taken in cross-replica
     context: a non-finite step leaves weights, optimizer state (moments, iterations) and the
     model's non-trainable state (batch-norm statistics, put back from a copy taken before the step)
     untouched;
     the loss scale halves on overflow and doubles after GROWTH_INTERVAL good steps.

`Task.apply_gradients` only records the gradients (thread-local: MirroredStrategy traces each
replica on its own thread); the engine (engine/loop.py) sums the records of the micro-batches and
calls `Updater.apply`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import tensorflow as tf

from engine.errors import UserError

INITIAL_LOSS_SCALE = 2.0**15
GROWTH_INTERVAL = 2000  # good steps before the loss scale doubles
MIN_LOSS_SCALE = 1.0  # an overflow at this scale is a real non-finite gradient

_local = threading.local()


@dataclasses.dataclass
class Handed:
    """What one trace of a train_step handed to the engine on this replica."""
    gradients: list | None = None
    variables: list | None = None
    scaled: bool = False  # the step called Task.scale_loss


@contextlib.contextmanager
def collecting():
    """Collects what Task.apply_gradients / Task.scale_loss are given while tracing; yields a Handed."""
    handed, previous = Handed(), getattr(_local, "handed", None)
    _local.handed = handed
    try:
        yield handed
    finally:
        _local.handed = previous


def hand_over(gradients, variables) -> None:
    """Task.apply_gradients: records this replica's gradients for the engine's update."""
    handed = getattr(_local, "handed", None)
    if handed is None:
        raise UserError("Task.apply_gradients is only valid inside the engine's train_step")
    if handed.gradients is not None:
        raise UserError("train_step called self.apply_gradients twice; add the losses (or the "
                        "gradients) and hand them over once per step")
    handed.gradients, handed.variables = list(gradients), list(variables)


def note_scaled() -> None:
    handed = getattr(_local, "handed", None)
    if handed is not None:
        handed.scaled = True


def all_finite(tensors) -> tf.Tensor:
    """True when every element of every tensor (None entries ignored) is finite."""
    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


@contextlib.contextmanager
def _already_reduced():
    previous = getattr(_local, "reduced", False)
    _local.reduced = True
    try:
        yield
    finally:
        _local.reduced = previous


def _skip_keras_all_reduce(optimizer) -> None:
    """Makes optimizer.apply skip Keras' own all-reduce while the engine applies summed gradients
    (only then: a Task calling self.optimizer.apply_gradients itself still gets Keras' sum)."""
    original = getattr(optimizer, "_all_reduce_sum_gradients", None)
    if original is None:
        raise UserError(
            "this Keras version's optimizer has no _all_reduce_sum_gradients: the engine cannot hand "
            "it gradients already summed over replicas; use keras 3.x (tested 3.15)")
    if getattr(original, "_engine_wrapped", False):
        return

    def all_reduce_sum_gradients(grads_and_vars):
        return list(grads_and_vars) if getattr(_local, "reduced", False) else original(grads_and_vars)

    all_reduce_sum_gradients._engine_wrapped = True
    optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients


@dataclasses.dataclass
class Outcome:
    """One step's update, the same value on every replica."""
    applied: tf.Tensor  # bool: the optimizer stepped
    bad: tf.Tensor  # bool: non-finite gradients that loss scaling does not explain
    grad_norm: tf.Tensor  # float32: global norm of the summed, unscaled gradients (before clipping)
    gradients: list  # the summed, unscaled gradients


class Updater:
    """Build inside strategy.scope() (it may own loss-scale variables)."""

    def __init__(self, optimizer, *, loss_scaling: bool, clip_norm: float = 0.0):
        self.optimizer = optimizer
        self.clip_norm = clip_norm
        self.loss_scaling = loss_scaling
        _skip_keras_all_reduce(optimizer)
        self.loss_scale = self.good_steps = None
        if loss_scaling:
            only_first = tf.VariableAggregation.ONLY_FIRST_REPLICA
            self.loss_scale = tf.Variable(INITIAL_LOSS_SCALE, dtype=tf.float32, trainable=False,
                                          name="loss_scale", aggregation=only_first)
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale_good_steps",
                                          aggregation=only_first)

    def checkpoint_items(self) -> dict:
        """Variables a resumed run needs (the loss scale and its counter), for tf.train.Checkpoint."""
        if not self.loss_scaling:
            return {}
        return {"loss_scale": self.loss_scale, "loss_scale_good_steps": self.good_steps}

    def scale(self, loss):
        """Task.scale_loss: the loss times the current loss scale (the loss itself without scaling)."""
        note_scaled()
        if not self.loss_scaling:
            return loss
        return loss * tf.cast(self.loss_scale, loss.dtype)

    def apply(self, gradients, variables, kept_state) -> Outcome:
        """Replica context: sum over replicas, unscale, check, clip, apply (see the module doc).

        gradients: this replica's, one per entry of `variables` (no None entries).
        kept_state: (variables, their values before the step), put back when the update is skipped:
        the batch-norm moving statistics, which the forward pass already moved (maybe to NaN)."""
        context = tf.distribute.get_replica_context()
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(g, tf.float32) for g in gradients])
        if self.loss_scaling:
            scale = tf.identity(self.loss_scale)  # read before the update below changes it
            summed = [g * (1.0 / scale) for g in summed]
        finite = all_finite(summed)
        norm = tf.linalg.global_norm(summed)
        clipped = summed
        if self.clip_norm:
            factor = self.clip_norm / tf.maximum(norm, self.clip_norm)
            clipped = [g * factor for g in summed]
        clipped = [tf.cast(g, v.dtype) for g, v in zip(clipped, variables)]
        applied = context.merge_call(self._apply_or_skip, args=(clipped, finite, list(kept_state[1])),
                                     kwargs={"variables": variables, "kept": list(kept_state[0])})
        bad = tf.logical_not(finite)
        if self.loss_scaling:  # an overflow is only bad once the scale cannot fall further
            bad = tf.logical_and(bad, tf.less_equal(scale, MIN_LOSS_SCALE))
        return Outcome(applied=applied, bad=bad, grad_norm=norm, gradients=summed)

    def _apply_or_skip(self, strategy, gradients, finite, before, *, variables, kept):
        """Cross-replica context: a cond here may call the optimizer (whose update needs a
        merge_call, impossible inside a cond in replica context)."""
        # `finite` comes from summed gradients, so every replica's copy is the same value.
        finite = strategy.experimental_local_results(finite)[0]

        def update(grads):
            with _already_reduced():
                self.optimizer.apply(list(grads), variables)

        def good():
            strategy.extended.call_for_each_replica(update, args=(gradients,))
            if self.loss_scaling:
                grow = self.good_steps + 1 >= GROWTH_INTERVAL
                self.loss_scale.assign(tf.where(grow, self.loss_scale * 2.0, self.loss_scale))
                self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))
            return tf.constant(True)

        def overflow():
            for variable, value in zip(kept, before):
                strategy.extended.update(variable, _assign, args=(value,), group=False)
            if self.loss_scaling:
                self.loss_scale.assign(tf.maximum(self.loss_scale * 0.5, MIN_LOSS_SCALE))
                self.good_steps.assign(0)
            return tf.constant(False)

        return tf.cond(finite, good, overflow)


def _assign(variable, value):
    return variable.assign(value)


def snapshot(variables) -> tuple:
    """(variables, their current values), for Updater.apply's kept_state (replica context)."""
    variables = [getattr(v, "value", v) for v in variables]
    return variables, [tf.identity(v) for v in variables]
