"""Tasks whose augment_example returns another structure than (features, label), for
tests/test_views.py (loaded with --task=tests/tasks_views.py:Name or in-process)."""

from __future__ import annotations

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


def _two_views(features, seed):
    """Two seeded augmentations of one image: each flipped left-right or not, plus a little noise."""
    views = []
    for salt in (0, 1):
        view_seed = tf.random.experimental.stateless_fold_in(seed, salt)
        flip = tf.random.stateless_uniform([], seed=view_seed) < 0.5
        view = tf.where(flip, tf.reverse(features, axis=[1]), features)
        noise_seed = tf.random.experimental.stateless_fold_in(view_seed, 7)
        views.append(view + 0.05 * tf.random.stateless_normal(tf.shape(features), seed=noise_seed))
    return tf.stack(views)


class TwoViewsTask(Task):
    """SimCLR-style input: augment_example returns two views stacked (2, H, W, C); train_step
    classifies the mean of both views' logits and adds a consistency term between them."""

    def augment_example(self, features, label, seed):
        return _two_views(features, seed), label

    def train_step(self, batch):
        views, labels = batch
        with tf.GradientTape() as tape:
            first = self.model(views[:, 0], training=True)
            second = self.model(views[:, 1], training=True)
            logits = (first + second) / 2.0
            per_example = self.per_example_loss(labels, logits)
            consistency = tf.reduce_sum(tf.square(first - second), axis=-1)
            loss = replica_loss(per_example + 0.1 * consistency, self.global_batch, self.model.losses)
        self.apply_gradients(tape.gradient(self.scale_loss(loss), self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)


class DictViewsTask(Task):
    """augment_example returns a dict of two views (one of another size) and a float label copy."""

    def augment_example(self, features, label, seed):
        views = _two_views(features, seed)
        return {"view": views[0], "small": views[1, ::2, ::2], "label": label, "weight": tf.cast(label, tf.float32)}

    def train_step(self, batch):
        labels = batch["label"]
        small = tf.image.resize(batch["small"], tf.shape(batch["view"])[1:3])
        with tf.GradientTape() as tape:
            logits = (self.model(batch["view"], training=True) + self.model(small, training=True)) / 2.0
            per_example = self.per_example_loss(labels, logits) * (1.0 + 0.0 * batch["weight"])
            loss = replica_loss(per_example, self.global_batch, self.model.losses)
        self.apply_gradients(tape.gradient(self.scale_loss(loss), self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)


class VaryingCropTask(Task):
    """augment_example crops each example to a random height: a shape that differs per example."""

    def augment_example(self, features, label, seed):
        height = tf.random.stateless_uniform([], seed=seed, minval=4, maxval=8, dtype=tf.int32)
        return features[:height], label


class PythonObjectTask(Task):
    """augment_example returns a Python object beside the features: nothing the engine can batch."""

    def augment_example(self, features, label, seed):
        return features, label, object()
