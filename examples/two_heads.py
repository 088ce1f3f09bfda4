"""A two-headed (multi-task) classifier: class logits and a second head regressing each image's
mean brightness, trained on the sum of both losses.

    python run.py --task=examples/two_heads.py:TwoHeadedTask --dataset=fashion_mnist \
        --strategy=mirrored --cpu_replicas=2 --summaries=full

Shows: a model with several outputs (`build_model` returns a keras.Model with a list of outputs);
`classifier_output` names the one holding the class logits, so the confusion matrix, the PR curves
and the misclassified pictures use it; a per-example loss made of two terms, summed and divided by
the global batch by `replica_loss` (N replicas train like one); the SavedModel serves both
outputs (`outputs_0`, `outputs_1`: docs/serving.md).
"""

import keras
import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class TwoHeadedTask(Task):
    """Class logits ("classes") and a second head ("size", the image's mean brightness)."""

    classifier_output = "classes"  # an output layer's name (or its index, 0)
    brightness_weight = 1.0  # how much the second head's squared error counts in the loss

    def build_model(self):
        inputs = keras.Input(self.input_shape)
        hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(inputs))
        classes = keras.layers.Dense(self.num_classes, name="classes")(hidden)
        size = keras.layers.Dense(1, name="size")(hidden)
        return keras.Model(inputs, [classes, size])

    def _losses(self, images, labels, training):
        logits, size = self.model(images, training=training)
        brightness = tf.reduce_mean(tf.reshape(tf.cast(images, tf.float32), [tf.shape(images)[0], -1]), axis=1)
        squared = tf.square(tf.cast(size[:, 0], tf.float32) - brightness)
        return logits, self.per_example_loss(labels, logits) + self.brightness_weight * squared

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
