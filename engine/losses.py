"""Loss scaling across replicas: the one rule that makes N replicas train like one."""

from __future__ import annotations

import tensorflow as tf


def replica_loss(per_example_loss, global_batch: int, regularization_losses=()):
    """This replica's share of the global-batch mean loss.

    sum(per-example losses on this replica) / GLOBAL batch, plus regularisation divided by the
    replica count. Summed over replicas (which is what the all-reduce of the gradients does) this
    is exactly the mean loss of one replica fed the whole global batch. Dividing by the
    per-replica batch instead would scale every gradient by the replica count.
    """
    loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch)
    regularization_losses = list(regularization_losses)
    if regularization_losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(regularization_losses))
    return loss


def per_replica_mean_loss(per_example_loss):
    """The classic mistake, kept for the tests that show why `replica_loss` is needed:
    the mean over this replica's examples only. Do not train with it."""
    return tf.reduce_mean(per_example_loss)
