"""Non-finite losses and gradients, decided the same way on every replica and worker.

`apply_gradients` (behind `Task.apply_gradients`) all-reduces a "this replica's gradients are not
finite" flag across ALL replicas (one scalar collective per step, taken unconditionally by every
replica: invariant 5), so every replica takes the same decision. With skip=False it applies the
gradients as given; with skip=True a bad step leaves the weights AND the optimizer state
(iterations, moments) exactly as they were:

  * Keras 3's optimizer cannot run inside a tf.cond under MirroredStrategy (its merge_call fails
    there), so the update always runs, with the gradients replaced by zeros on a bad step;
  * zeros are not enough (Adam still moves the weights by its momentum and counts the step), so
    every trainable and optimizer variable is read before the update and, in one merge_call after
    it, written back to that value when the step was bad (a select, no conditional).

The flag also reaches the compiled loop (engine/loop.py): the replica step records it in a
thread-local list while the Task's train_step is traced (MirroredStrategy traces each replica on
its own thread), and the loop stops or skips on it without any host sync.

The same recording keeps the gradients the optimizer applies AFTER its cross-replica sum (Keras
3's `_all_reduce_sum_gradients`, wrapped once per optimizer), so the loop can report the exact
global gradient norm (and gradient histograms) without a second all-reduce: per-replica gradients
are partial sums, and the norm of a sum is not a sum of norms. With a Keras whose optimizer lacks
that method nothing is kept and the engine logs no gradient norm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import tensorflow as tf

_recorded = threading.local()


@dataclasses.dataclass
class Record:
    """What the apply_gradients calls traced inside `recording()` saw, on this replica."""
    flags: list = dataclasses.field(default_factory=list)  # all-replica finite flags
    reduced: list = dataclasses.field(default_factory=list)  # all-reduced gradients, per call


@contextlib.contextmanager
def recording():
    """Collects what the apply_gradients calls traced inside saw; yields a Record."""
    record = Record()
    previous = getattr(_recorded, "record", None)
    _recorded.record = record
    try:
        yield record
    finally:
        _recorded.record = previous


def _current_record():
    return getattr(_recorded, "record", None)


def keep_reduced_gradients(optimizer) -> None:
    """Wraps optimizer._all_reduce_sum_gradients (once) to record its output while recording.

    Call before the first trace (engine/loop.py does): replicas trace on their own threads."""
    original = getattr(optimizer, "_all_reduce_sum_gradients", None)
    if original is None or getattr(original, "_engine_keeps", False):
        return

    def all_reduce_sum_gradients(grads_and_vars):
        reduced = original(grads_and_vars)
        record = _current_record()
        if record is not None:
            record.reduced.append([g for g, _ in reduced])
        return reduced

    all_reduce_sum_gradients._engine_keeps = True
    optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients


def global_norm(gradient_lists) -> tf.Tensor | None:
    """The L2 norm over every recorded (all-reduced) gradient; None when none was recorded."""
    tensors = [g for grads in gradient_lists for g in grads if g is not None]
    if not tensors:
        return None
    return tf.linalg.global_norm([tf.cast(g, tf.float32) for g in tensors])


def recorded_all_finite(flags) -> tf.Tensor:
    """True unless one of the recorded (already all-reduced) flags is False."""
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def all_finite(tensors) -> tf.Tensor:
    """True when every element of every tensor (None entries ignored) is finite."""
    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def replicas_all_finite(tensors) -> tf.Tensor:
    """all_finite over the tensors of EVERY replica (an all-reduce, in replica context)."""
    context = tf.distribute.get_replica_context()
    local_bad = 1.0 - tf.cast(all_finite(tensors), tf.float32)
    return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, local_bad), 0.0)


def apply_gradients(optimizer, gradients, variables, skip: bool) -> tf.Tensor:
    """optimizer.apply_gradients, checked across replicas; returns the all-replica finite flag."""
    gradients, variables = list(gradients), list(variables)
    finite = replicas_all_finite(gradients)
    record = _current_record()
    if record is not None:
        record.flags.append(finite)
    if not skip:
        optimizer.apply_gradients(zip(gradients, variables))
        return finite
    safe = [None if g is None else tf.where(finite, g, tf.zeros_like(g)) for g in gradients]
    state = [getattr(v, "value", v) for v in [*variables, *optimizer.variables]]
    before = [tf.identity(v) for v in state]  # ordered before the update by auto control deps
    optimizer.apply_gradients(zip(safe, variables))
    tf.distribute.get_replica_context().merge_call(
        functools.partial(_restore_if_bad, state=state), args=(finite, before))
    return finite


def _restore_if_bad(strategy, finite, before, *, state):
    """Cross-replica context: every variable back to its value before the update on a bad step."""
    for variable, value in zip(state, before):
        strategy.extended.update(variable, _select, args=(finite, value), group=False)


def _select(variable, finite, value):
    return variable.assign(tf.where(finite, variable, value))
