"""An input-gradient penalty ("double backpropagation", Drucker & LeCun 1992) as a Task: the loss
plus lambda * ||d loss_i / d x_i||^2 for each example, which flattens the loss around the data.

    python run.py --task=examples/gradient_penalty.py:GradientPenaltyTask --model=mlp

Shows: nested tapes in a step, a per-example penalty that goes through replica_loss like any
per-example loss (so N replicas train like one), and an extra metric.
"""

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class GradientPenaltyTask(Task):
    weight = 0.1  # lambda
    train_metrics = ("loss", "accuracy", "penalty")

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            with tf.GradientTape() as input_tape:
                input_tape.watch(images)
                logits = self.model(images, training=True)
                per_example = self.per_example_loss(labels, logits)
            # Example i's loss depends on input i only, so this is each example's own input gradient.
            input_gradients = input_tape.gradient(per_example, images)
            penalty = tf.reduce_sum(tf.square(tf.reshape(input_gradients, [tf.shape(images)[0], -1])), axis=1)
            loss = replica_loss(per_example + self.weight * penalty, self.global_batch, self.model.losses)
            scaled = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled, self.model.trainable_variables))
        metrics = classification_metrics(labels, logits, per_example)
        return dict(metrics, penalty=(tf.reduce_sum(penalty), metrics["loss"][1]))
