"""The compiled inner loops: many `strategy.run` steps per tf.function call.

Each step's metrics {name: (total, count)} are reduced across replicas with
strategy.reduce(SUM) and summed over the steps of the loop. The step count is a tensor, so a
loop of any length reuses one trace (no retracing between the loops of a run).

A training step is bad when a reduced metric total is not finite (a NaN/Inf loss on any replica)
or when Task.apply_gradients saw a non-finite gradient on any replica (engine/nonfinite.py). Both
are all-reduced values, the same on every replica and worker, so every replica takes the same
branch, and the decision stays on the device (no host sync per step): with stop, the loop ends
before counting the bad step; with skip, the step counts (its batch is consumed) but its metrics
do not.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from engine import nonfinite
from engine.errors import UserError

# Iterating a distributed dataset inside tf.function makes tf.data warn about options it cannot
# see at trace time; the engine sets its options before distributing, so the warning is noise.
warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")


def _zeros(names):
    return {name: (tf.constant(0.0), tf.constant(0.0)) for name in names}


def _check_names(outputs, names, step_name):
    if not isinstance(outputs, dict) or tuple(sorted(outputs)) != tuple(sorted(names)):
        got = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise UserError(
            f"{step_name} returned {got}; it must return a dict with exactly the names "
            f"{sorted(names)} (declared in the Task), each a (total, count) pair"
        )


def _float32_outputs(step_fn, names, step_name):
    """Wraps a Task step (replica context): checks its names, casts its values to float32."""

    def replica_step(batch):
        outputs = step_fn(batch)
        _check_names(outputs, names, step_name)
        return {name: (tf.cast(outputs[name][0], tf.float32), tf.cast(outputs[name][1], tf.float32))
                for name in names}

    return replica_step


def _recording(step_fn, grad_norm: bool, gradients: bool):
    """step_fn(batch) -> (outputs, all-replica finite flag, all-reduced gradients or []).

    With grad_norm, outputs gains "grad_norm": (global norm of the all-reduced gradients, 1) on
    every replica, so the SUM over replicas and steps divided by the count is the mean per step;
    (0, 0) when the step applied no gradients through Task.apply_gradients."""

    def step(batch):
        with nonfinite.recording() as record:
            outputs = step_fn(batch)
        if grad_norm:
            norm = nonfinite.global_norm(record.reduced)
            outputs = dict(outputs, grad_norm=(tf.constant(0.0), tf.constant(0.0)) if norm is None
                           else (norm, tf.constant(1.0)))
        kept = [g for grads in record.reduced for g in grads] if gradients else []
        return outputs, nonfinite.recorded_all_finite(record.flags), kept

    return step


def _reduce(strategy, outputs):
    """SUM over replicas of outputs, per metric and per (total, count) element."""

    def reduce(value):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    return {name: (reduce(total), reduce(count)) for name, (total, count) in outputs.items()}


def _add(totals, more):
    return {name: (totals[name][0] + more[name][0], totals[name][1] + more[name][1]) for name in totals}


def _reduce_and_add(strategy, totals, outputs):
    """totals + SUM over replicas of outputs."""
    return _add(totals, _reduce(strategy, outputs))


def make_train_loop(strategy, task, global_step: tf.Variable, jit_compile: bool = False,
                    skip_nonfinite: bool = False, grad_norm: bool = False, gradients: bool = False):
    """train_loop(iterator, num_steps) -> (totals, steps, bad_steps), or with `gradients`
    (totals, steps, bad_steps, last_gradients).

    totals: {name: (total, count)} summed over replicas and the good steps; with grad_norm it also
    holds "grad_norm" (mean global gradient norm per step, computed from the gradients the
    optimizer applies after its all-reduce: no extra collective). steps: the steps run, each added
    to `global_step` as it ends, so the counter always matches the weights. bad_steps: with
    skip_nonfinite, how many steps were skipped; otherwise 1 when the loop stopped early at a
    non-finite step (the step numbered global_step + 1, not counted, its update not checkpointed).
    last_gradients: the all-reduced gradients of the loop's last step, as the first local replica
    holds them (the same on every replica), for histograms.
    """
    metric_names = tuple(task.train_metrics)
    names = metric_names + (("grad_norm",) if grad_norm else ())
    if grad_norm or gradients:
        nonfinite.keep_reduced_gradients(task.optimizer)
    step_fn = _recording(_float32_outputs(task.train_step, metric_names, "train_step"), grad_norm, gradients)
    replica_step = tf.function(step_fn, jit_compile=True) if jit_compile else step_fn

    @tf.function
    def train_loop(iterator, num_steps):
        totals = _zeros(names)
        steps = tf.constant(0, tf.int32)
        bad_steps = tf.constant(0, tf.int32)
        last = [tf.zeros(v.shape, v.dtype) for v in task.model.trainable_variables] if gradients else []
        for _ in tf.range(num_steps):
            outputs, gradients_finite, kept = strategy.run(replica_step, args=(next(iterator),))
            step_totals = _reduce(strategy, outputs)
            if gradients:
                local = [strategy.experimental_local_results(g)[0] for g in kept]
                if len(local) == len(last):
                    last = [tf.cast(g, v.dtype) for g, v in zip(local, last)]
            # Already all-reduced in the step, so any local replica's copy is everyone's value.
            # The gradient norm stays out of the check: the finite flag already covers gradients.
            checked = {k: v for k, v in step_totals.items() if k != "grad_norm"}
            finite = tf.logical_and(strategy.experimental_local_results(gradients_finite)[0],
                                    nonfinite.all_finite(tf.nest.flatten(checked)))
            if not skip_nonfinite and not finite:
                bad_steps = tf.constant(1, tf.int32)
                break
            # A skipped step's (maybe NaN) metrics stay out of the totals.
            totals = _add(totals, tf.nest.map_structure(lambda v: tf.where(finite, v, 0.0), step_totals))
            bad_steps += 1 - tf.cast(finite, tf.int32)
            steps += 1
            global_step.assign_add(1)
        if gradients:
            return totals, steps, bad_steps, last
        return totals, steps, bad_steps

    return train_loop


def make_eval_loop(strategy, task):
    """eval_loop(distributed_dataset) -> {name: (total, count)} over EVERY example of the dataset."""
    names = tuple(task.eval_metrics)
    replica_step = _float32_outputs(task.eval_step, names, "eval_step")

    @tf.function
    def eval_loop(distributed_dataset):
        totals = _zeros(names)
        for batch in distributed_dataset:
            outputs = strategy.run(replica_step, args=(batch,))
            totals = _reduce_and_add(strategy, totals, outputs)
        return totals

    return eval_loop


def ratios(totals) -> dict:
    """{name: total / count} as Python floats (one host sync for the whole dict)."""
    values = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, totals)
    return {name: float(total) / float(count) if count else float("nan") for name, (total, count) in values.items()}
