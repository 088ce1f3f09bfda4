"""Tasks for tests/test_after_update.py: state moved once per optimizer update (Task.after_update)
and the micro-batch index (Task.micro_batch)."""

from __future__ import annotations

import tensorflow as tf

from engine.task import Task
from examples.moco import MocoTask
from tasks_nonfinite import nan_on_last_replica_at


class CountingUpdatesTask(Task):
    """Counts after_update's runs and the micro-batches train_step saw, by index (checkpointed).
    The last replica's gradients are NaN at step `nan_at_step` (-1: never), so that update is skipped
    under --on_nonfinite=skip."""

    nan_at_step = -1

    def build_extras(self):
        self.updates = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.micro_batches_seen = tf.Variable(tf.zeros([4], tf.int64), trainable=False)

    def train_step(self, batch):
        seen = tf.one_hot(self.micro_batch, 4, dtype=tf.int64)
        self.micro_batches_seen.assign_add(seen)
        return super().train_step(batch)

    def apply_gradients(self, gradients, variables=None):
        poison = nan_on_last_replica_at(self, self.nan_at_step)
        return super().apply_gradients([g * poison for g in gradients], variables)

    def after_update(self):
        self.updates.assign_add(1)


class SkippingUpdatesTask(CountingUpdatesTask):
    """CountingUpdatesTask whose update to step 3 has non-finite gradients."""

    nan_at_step = 2


class CollectiveAfterUpdateTask(Task):
    """Calls self.all_reduce in after_update (refused in one line)."""

    def build_extras(self):
        self.total = tf.Variable(0.0, trainable=False)

    def after_update(self):
        self.total.assign_add(self.all_reduce(tf.constant(1.0)))


class SmallMocoTask(MocoTask):
    """examples/moco.py's Task with a queue of two global batches of the tests' runs."""

    QUEUE = 128
