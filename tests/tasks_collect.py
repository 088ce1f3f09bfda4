"""Tasks for tests/test_collect.py (loaded with --task=tests/tasks_collect.py:Name): the AUC/F1
example's Task recording what eval_summary got, and steps that misuse the whole-set API."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from engine.task import Task
from examples.auc_f1 import AucF1Task


class RecordingAucF1Task(AucF1Task):
    """examples/auc_f1.py's Task that also writes what eval_summary got and returned, at each
    evaluation, to <model_dir>/collected-<pid>.npz (the last evaluation's stays)."""

    def eval_summary(self, collected):
        summary = super().eval_summary(collected)
        path = os.path.join(self.config.model_dir, f"collected-{os.getpid()}.npz")
        np.savez(path, **collected, **{f"summary_{name}": value for name, value in summary.items()})
        return summary


class GatherCollectTask(AucF1Task):
    """The pairwise flag test's Task: the AUC/F1 Task (collects in eval_step) whose train_step also
    gathers every replica's labels with self.all_gather (their sum enters the loss times 0) into a
    variable at its micro-batch's row, which after_update adds up once per update."""

    def build_extras(self):
        self.gathered = tf.Variable(tf.zeros([4]), trainable=False)  # one row per micro-batch
        self.label_sum = tf.Variable(0.0, trainable=False)

    def train_step(self, batch):
        outputs = super().train_step(batch)
        gathered = self.all_gather(tf.cast(batch[1], tf.float32))
        self.gathered.assign(
            tf.tensor_scatter_nd_update(self.gathered, [[self.micro_batch]], [tf.reduce_sum(gathered)])
        )
        return dict(outputs, loss=(outputs["loss"][0] + 0.0 * tf.reduce_sum(gathered), outputs["loss"][1]))

    def after_update(self):
        self.label_sum.assign_add(tf.reduce_sum(self.gathered))
        self.gathered.assign(tf.zeros([4]))


class VectorTotalTask(Task):
    """train_step returns a per-class vector as a metric's total (refused in one line)."""

    train_metrics = ("loss", "accuracy", "per_class")

    def train_step(self, batch):
        outputs = super().train_step(batch)
        per_class = tf.reduce_sum(tf.one_hot(tf.cast(batch[1], tf.int32), 10), axis=0)
        return dict(outputs, per_class=(per_class, tf.reduce_sum(per_class)))


class TrainCollectTask(Task):
    """Calls self.collect in train_step (only eval_step may)."""

    def train_step(self, batch):
        self.collect("labels", batch[1])
        return super().train_step(batch)
