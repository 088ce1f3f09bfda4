"""Tasks for the comparisons of runs (N replicas or workers train like one, a seed repeats) and the
scaling mistakes that break them: tests/test_equivalence.py, tests/test_models.py,
tests/test_combinations.py, tests/test_randomness.py, tests/test_resume.py,
tests/test_worked_example.py and tests/test_language_model.py load them with
--task=tests/tasks_equivalence.py:Name or import them."""

from __future__ import annotations

import keras
import tensorflow as tf

from engine.losses import per_replica_mean_loss
from engine.models.classifiers import cnn_bn
from engine.task import Task, classification_metrics
from engine.tasks.label_smoothing import LabelSmoothingTask
from engine.tasks.language_model import LanguageModelTask


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


class LocalTokenMeanTask(LanguageModelTask):
    """The per-token trap: each replica divides by its OWN real-token count (times the replica
    count, so it is right whenever every replica holds as many real tokens): a replica of mostly
    padding then weighs as much as a full one."""

    def normaliser(self, labels):
        context = tf.distribute.get_replica_context()
        local = tf.reduce_sum(tf.cast(labels >= 0, tf.float32))
        return tf.maximum(local, 1.0) * context.num_replicas_in_sync


class DropoutTask(Task):
    """A small MLP with Dropout, trained on inputs with Gaussian noise drawn from Task.random_seed:
    both random ops must differ per replica and repeat with --seed."""

    def build_model(self):
        return keras.Sequential(
            [
                keras.Input(shape=self.input_shape),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(self.num_classes, dtype="float32"),
            ],
            name="dropout_mlp",
        )

    def train_step(self, batch):
        images, labels = batch
        noise = tf.random.stateless_normal(tf.shape(images), seed=self.random_seed(), dtype=images.dtype)
        return super().train_step((images + 0.1 * noise, labels))


class QuietLabelSmoothingTask(LabelSmoothingTask):
    """The worked example without its input noise (then N replicas must train like one) and with a
    penalty strong enough that counting it once per replica would show in the weights."""

    INPUT_NOISE = 0.0
    PENALTY = 0.1


class CnnBnNoDropoutTask(Task):
    """cnn_bn without dropout (Keras draws a dropout mask per replica slice, so masks depend on the
    replica count) and with fast-moving batch-norm statistics (momentum 0.5), so that a few steps
    show whether the statistics are those of the global batch."""

    synchronized = True

    def build_model(self):
        return cnn_bn(self.input_shape, self.num_classes, dropout=0.0, momentum=0.5, synchronized=self.synchronized)


class UnsyncedCnnBnNoDropoutTask(CnnBnNoDropoutTask):
    """The same with each replica normalising by its own slice of the batch."""

    synchronized = False
