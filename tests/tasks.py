"""Tasks used by the tests (loaded with --task=tests/tasks.py:ClassName)."""

from __future__ import annotations

import tensorflow as tf

from engine.losses import per_replica_mean_loss
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
