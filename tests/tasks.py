"""Tasks used by the tests (loaded with --task=tests/tasks.py:ClassName)."""

from __future__ import annotations

import tensorflow as tf

from engine.losses import per_replica_mean_loss
from engine.models import cnn_bn
from engine.task import Task, classification_metrics


class PerReplicaMeanTask(Task):
    """The classic scaling mistake: each replica averages over its own examples only."""

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            loss = per_replica_mean_loss(per_example)
        gradients = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)


class ModelOutsideScopeTask(Task):
    """Builds its model in __init__, outside strategy.scope(): the engine must refuse it."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self._prebuilt = super().build_model()

    def build_model(self):
        return self._prebuilt


class WrongMetricsTask(Task):
    """Returns names it did not declare."""

    def eval_step(self, batch):
        return {"loss": (tf.constant(0.0), tf.constant(1.0))}


class NotATask:
    pass


class FailOnWorkerOneTask(Task):
    """Fails on worker 1 only (as a bug in one worker's environment would)."""

    def __init__(self, config, **kwargs):
        import json
        import os

        from engine.errors import UserError

        if json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index") == 1:
            raise UserError("FailOnWorkerOneTask: worker 1 fails on purpose")
        super().__init__(config, **kwargs)


def _nan_on_last_replica_at(task, step):
    """NaN on the last replica while global_step == step (the update to step + 1), else 1.0."""
    context = tf.distribute.get_replica_context()
    last = tf.equal(context.replica_id_in_sync_group, context.num_replicas_in_sync - 1)
    bad = tf.logical_and(last, tf.equal(task.global_step, step))
    return tf.where(bad, float("nan"), 1.0)


class NanGradientTask(Task):
    """The last replica's gradients are NaN at one step; its loss stays finite."""

    nan_at_step = 5

    def apply_gradients(self, gradients, variables=None):
        poison = _nan_on_last_replica_at(self, self.nan_at_step)
        return super().apply_gradients([g * poison for g in gradients], variables)


class NanLossTask(Task):
    """The last replica's per-example losses (so its loss metric and gradients) are NaN at one step.

    Eval steps see the poison too when an evaluation falls on that step: schedule around it.
    """

    nan_at_step = 5

    def per_example_loss(self, labels, outputs):
        return super().per_example_loss(labels, outputs) * _nan_on_last_replica_at(self, self.nan_at_step)


class CnnBnNoDropoutTask(Task):
    """cnn_bn without dropout (Keras draws a dropout mask per replica slice, so masks depend on the
    replica count) and with fast-moving batch-norm statistics (momentum 0.5), so that a few steps
    show whether the statistics are those of the global batch."""

    synchronized = True

    def build_model(self):
        return cnn_bn(self.input_shape, self.num_classes, dropout=0.0, momentum=0.5,
                      synchronized=self.synchronized)


class UnsyncedCnnBnNoDropoutTask(CnnBnNoDropoutTask):
    """The same with each replica normalising by its own slice of the batch."""

    synchronized = False
