"""An input-gradient penalty ("double backpropagation", Drucker & LeCun, 1992) as a Task: each
example's loss plus lambda * ||d loss_i / d x_i||^2, which flattens the loss around the data.

    python run.py --task=examples/gradient_penalty.py:GradientPenaltyTask --model=mlp --dataset=fashion_mnist

Shows: nested tapes in a step (a gradient inside the loss, differentiated again), a per-example
penalty that goes through replica_loss like any per-example loss (so N replicas train like one),
and an extra metric, `penalty`. One batched input gradient gives every example its own only when
example i's loss depends on x_i alone: true for mlp and cnn, not for batch norm in training mode
(cnn_bn, resnet20), where each example's loss depends on the whole batch's statistics.
"""

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class GradientPenaltyTask(Task):
    weight = 0.1  # lambda
    train_metrics = ("loss", "accuracy", "penalty")

    def penalised_loss(self, images, labels):
        """(logits, per-example cross-entropy, per-example ||d loss_i / d x_i||^2), differentiable."""
        with tf.GradientTape() as input_tape:
            input_tape.watch(images)
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
        # d (sum of the losses) / d x_i = d loss_i / d x_i when loss_i depends on x_i only.
        input_gradients = input_tape.gradient(per_example, images)
        flat = tf.reshape(tf.cast(input_gradients, tf.float32), [tf.shape(images)[0], -1])
        return logits, per_example, tf.reduce_sum(tf.square(flat), axis=1)

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits, per_example, penalty = self.penalised_loss(images, labels)
            loss = replica_loss(per_example + self.weight * penalty, self.global_batch, self.model.losses)
            scaled = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled, self.model.trainable_variables))
        metrics = classification_metrics(labels, logits, per_example)  # loss: the cross-entropy
        return dict(metrics, penalty=(tf.reduce_sum(penalty), metrics["loss"][1]))
