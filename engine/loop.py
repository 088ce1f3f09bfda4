"""The compiled inner loops: many `strategy.run` steps per tf.function call.

Each step's metrics {name: (total, count)} are reduced across replicas with
strategy.reduce(SUM) and summed over the steps of the loop. The step count is a tensor, so a
loop of any length reuses one trace (no retracing between the loops of a run).
"""

from __future__ import annotations

import warnings

import tensorflow as tf

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


def _reduce_and_add(strategy, totals, outputs):
    """totals + SUM over replicas of outputs, per metric and per (total, count) element."""

    def reduce(value):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    return {
        name: (totals[name][0] + reduce(outputs[name][0]), totals[name][1] + reduce(outputs[name][1]))
        for name in totals
    }


def make_train_loop(strategy, task, global_step: tf.Variable, jit_compile: bool = False):
    """train_loop(iterator, num_steps) -> {name: (total, count)} summed over replicas and steps.

    Also adds num_steps to `global_step`, so the step counter always matches the weights.
    """
    names = tuple(task.train_metrics)
    step_fn = tf.function(task.train_step, jit_compile=True) if jit_compile else task.train_step
    replica_step = _float32_outputs(step_fn, names, "train_step")

    @tf.function
    def train_loop(iterator, num_steps):
        totals = _zeros(names)
        for _ in tf.range(num_steps):
            outputs = strategy.run(replica_step, args=(next(iterator),))
            totals = _reduce_and_add(strategy, totals, outputs)
        global_step.assign_add(tf.cast(num_steps, global_step.dtype))
        return totals

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
