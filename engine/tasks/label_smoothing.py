"""A worked example of a changed step: `--task=label_smoothing`.

What it changes, each the way that stays correct on any number of replicas:
  * the loss: cross-entropy against smoothed labels (SMOOTHING of the target mass spread evenly);
  * a custom regulariser: an L2 penalty on the output layer's kernel, added through
    `replica_loss(..., regularization_losses=...)`, which divides it by the replica count
    (every replica adds it, the all-reduce sums them: counted once);
  * augmentation: Gaussian input noise drawn with `self.random_seed()`, so each replica (and each
    step) draws its own noise and a run with --seed repeats;
  * an extra metric, "penalty", declared in `train_metrics` and returned as (total, count).

Copy this file, change what you need and run it with `--task=path/to/your_file.py:YourTask`.
"""

from __future__ import annotations

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class LabelSmoothingTask(Task):
    SMOOTHING = 0.1  # share of each label's probability mass spread over all classes
    PENALTY = 1e-4  # weight of the L2 penalty on the output layer's kernel
    INPUT_NOISE = 0.05  # standard deviation of the Gaussian noise added to training images (0: off)

    train_metrics = ("loss", "accuracy", "penalty")  # "loss": the smoothed cross-entropy

    def per_example_loss(self, labels, outputs):
        targets = tf.one_hot(labels, self.num_classes)
        targets = targets * (1.0 - self.SMOOTHING) + self.SMOOTHING / self.num_classes
        return tf.nn.softmax_cross_entropy_with_logits(targets, tf.cast(outputs, tf.float32))

    def penalty(self):
        """The custom regulariser: L2 on the last layer's kernel (the logits' weights)."""
        return self.PENALTY * tf.reduce_sum(tf.square(self.model.layers[-1].kernel))

    def train_step(self, batch):
        images, labels = batch
        if self.INPUT_NOISE:
            noise = tf.random.stateless_normal(tf.shape(images), seed=self.random_seed(), dtype=images.dtype)
            images = images + self.INPUT_NOISE * noise
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            penalty = self.penalty()
            loss = replica_loss(per_example, self.global_batch, [*self.model.losses, penalty])
            scaled_loss = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled_loss, self.model.trainable_variables))
        metrics = classification_metrics(labels, logits, per_example)
        # Every replica holds the same weights, so report the penalty once: (value, 1) on replica 0.
        first = tf.cast(tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0), tf.float32)
        metrics["penalty"] = (penalty * first, first)
        return metrics
