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
"""

from __future__ import annotations

import contextlib
import functools
import threading

import tensorflow as tf

_recorded = threading.local()


@contextlib.contextmanager
def recording():
    """Collects the finite flags of the apply_gradients calls traced inside; yields the list."""
    flags = []
    previous = getattr(_recorded, "flags", None)
    _recorded.flags = flags
    try:
        yield flags
    finally:
        _recorded.flags = previous


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
    if hasattr(_recorded, "flags") and _recorded.flags is not None:
        _recorded.flags.append(finite)
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
