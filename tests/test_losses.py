"""The scaling helper: per-replica loss = sum of per-example losses / GLOBAL batch."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from engine.distribute.strategy import build_strategy
from engine.losses import per_replica_mean_loss, replica_loss

pytestmark = pytest.mark.fast  # every test here runs in seconds: the fast lane (-m fast)


def test_replica_losses_sum_to_the_global_mean():
    losses = tf.constant(np.arange(8, dtype=np.float32))
    halves = [losses[:4], losses[4:]]  # two replicas of a global batch of 8
    summed = sum(float(replica_loss(h, global_batch=8)) for h in halves)
    assert np.isclose(summed, float(tf.reduce_mean(losses)))


def test_per_replica_mean_overcounts_by_the_replica_count():
    losses = tf.constant(np.arange(8, dtype=np.float32))
    halves = [losses[:4], losses[4:]]
    summed = sum(float(per_replica_mean_loss(h)) for h in halves)
    assert np.isclose(summed, 2 * float(tf.reduce_mean(losses)))


def test_regularisation_is_counted_once_over_replicas():
    strategy = build_strategy("mirrored", 2).strategy  # the engine's (not collective all-reduce)

    def step():
        return replica_loss(tf.zeros([4]), global_batch=8, regularization_losses=[tf.constant(3.0)])

    per_replica = strategy.run(step)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    assert np.isclose(float(total), 3.0)
