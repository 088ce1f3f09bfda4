"""Tasks whose model has several outputs (tests/test_outputs.py)."""

from __future__ import annotations

import keras
import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class TwoHeadedTask(Task):
    """Class logits ("classes") and a second head ("size", the image's mean brightness): the
    pictures use the output classifier_output names."""

    classifier_output = "classes"

    def build_model(self):
        inputs = keras.Input(self.input_shape)
        hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(inputs))
        classes = keras.layers.Dense(self.num_classes, name="classes")(hidden)
        size = keras.layers.Dense(1, name="size")(hidden)
        return keras.Model(inputs, [classes, size])

    def _losses(self, images, labels, training):
        logits, size = self.model(images, training=training)
        brightness = tf.reduce_mean(tf.reshape(tf.cast(images, tf.float32), [tf.shape(images)[0], -1]), axis=1)
        per_example = self.per_example_loss(labels, logits) + tf.square(size[:, 0] - brightness)
        return logits, per_example

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits, per_example = self._losses(images, labels, True)
            loss = replica_loss(per_example, self.global_batch, self.model.losses)
        self.apply_gradients(tape.gradient(self.scale_loss(loss), self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)

    def eval_step(self, batch):
        images, labels = batch
        logits, per_example = self._losses(images, labels, False)
        return classification_metrics(labels, logits, per_example)


class TwoHeadedByIndexTask(TwoHeadedTask):
    classifier_output = 0


class TwoHeadedUnnamedTask(TwoHeadedTask):
    """Says nothing about its outputs: the pictures are off, with one banner line."""

    classifier_output = None


class FailingSummaryTask(Task):
    """Its after_eval raises on a line of this file: the run names the line and keeps the traceback."""

    def after_eval(self, step, writer):
        raise KeyError("no such summary")  # LINE OF THE FAILURE
