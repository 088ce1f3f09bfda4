"""Tasks that poison one replica at one step with NaN or +Inf (its gradients, inputs or losses), for
the non-finite checks: tests/test_nonfinite.py, tests/test_update.py, tests/test_rollback.py and
tests/test_multi_worker.py load them with --task=tests/tasks_nonfinite.py:Name."""

from __future__ import annotations

import tensorflow as tf

from engine.task import Task


def nan_on_last_replica_at(task, step, value=float("nan")):
    """`value` (NaN) on the last replica while global_step == step (the update to step + 1), else 1.0.
    Under MultiWorkerMirrored with 1 replica per worker, the last replica is the last worker's."""
    context = tf.distribute.get_replica_context()
    last = tf.equal(context.replica_id_in_sync_group, context.num_replicas_in_sync - 1)
    bad = tf.logical_and(last, tf.equal(task.global_step, step))
    return tf.where(bad, value, 1.0)


class NanGradientTask(Task):
    """The last replica's gradients are NaN at one step; its loss stays finite."""

    nan_at_step = 5

    def apply_gradients(self, gradients, variables=None):
        poison = nan_on_last_replica_at(self, self.nan_at_step)
        return super().apply_gradients([g * poison for g in gradients], variables)


class NanInputTask(Task):
    """The last replica's images are NaN at one step: its activations, so the batch-norm moving
    statistics the forward pass updates, become NaN too (not only the loss and gradients)."""

    nan_at_step = 5

    def train_step(self, batch):
        images, labels = batch
        return super().train_step((images * nan_on_last_replica_at(self, self.nan_at_step), labels))


class InfGradientTask(Task):
    """The last replica's gradients are +Inf at step 2 (as a float16 overflow on one replica would be)."""

    inf_at_step = 2

    def apply_gradients(self, gradients, variables=None):
        poison = nan_on_last_replica_at(self, self.inf_at_step, float("inf"))
        return super().apply_gradients([g * poison for g in gradients], variables)


class NanLossTask(Task):
    """The last replica's per-example losses (so its loss metric and gradients) are NaN at one step.

    Eval steps see the poison too when an evaluation falls on that step: schedule around it.
    """

    nan_at_step = 5

    def per_example_loss(self, labels, outputs):
        return super().per_example_loss(labels, outputs) * nan_on_last_replica_at(self, self.nan_at_step)
