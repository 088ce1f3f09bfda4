"""Tasks that hold more than the engine's model and optimizer (a second model with its own
optimizer, host-side state, step collectives) or say they are no classifier: tests/test_task_state.py
and tests/test_combinations.py load them with --task=tests/tasks_state.py:Name."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


def nan_on_last_replica_at(task, step):
    """NaN on the last replica while global_step == step, else 1.0 (as in tests/tasks_nonfinite.py:
    the engine loads each Task file by its path, so these files do not import one another)."""
    context = tf.distribute.get_replica_context()
    last = tf.equal(context.replica_id_in_sync_group, context.num_replicas_in_sync - 1)
    return tf.where(tf.logical_and(last, tf.equal(task.global_step, step)), float("nan"), 1.0)


class ProbeTask(Task):
    """Two models, two optimizers: the engine's classifier, plus a linear probe on the raw pixels
    with its own SGD optimizer, both handed to the engine (apply_gradients(optimizer=...))."""

    train_metrics = ("loss", "accuracy", "probe_loss")
    probe_every = 1  # the probe's optimizer steps at every probe_every-th step (when=...)
    probe_poison_at = -1  # at this step the last replica's probe gradients are NaN

    def build_extras(self):
        self.probe = keras.Sequential(
            [keras.layers.Input(self.input_shape), keras.layers.Flatten(), keras.layers.Dense(self.num_classes)],
            name="probe",
        )
        self.probe_optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        self.probe_optimizer.build(self.probe.trainable_variables)

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape, tf.GradientTape() as probe_tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            loss = self.scale_loss(replica_loss(per_example, self.global_batch, self.model.losses))
            probe_per_example = self.per_example_loss(labels, self.probe(images, training=True))
            probe_loss = self.scale_loss(replica_loss(probe_per_example, self.global_batch))
        self.apply_gradients(tape.gradient(loss, self.model.trainable_variables))
        poison = nan_on_last_replica_at(self, self.probe_poison_at)
        when = None if self.probe_every == 1 else tf.equal(self.global_step % self.probe_every, 0)
        self.apply_gradients(
            [g * poison for g in probe_tape.gradient(probe_loss, self.probe.trainable_variables)],
            self.probe.trainable_variables,
            optimizer=self.probe_optimizer,
            when=when,
        )
        metrics = classification_metrics(labels, logits, per_example)
        return dict(metrics, probe_loss=(tf.reduce_sum(probe_per_example), metrics["loss"][1]))


class EveryOtherProbeTask(ProbeTask):
    probe_every = 2


class PoisonedProbeTask(ProbeTask):
    probe_poison_at = 3


class CountingProbeTask(ProbeTask):
    """Keeps a host-side numpy count of evaluations: state no checkpoint holds (warned about)."""

    def build_extras(self):
        super().build_extras()
        self.evaluations = np.zeros(1)

    def derived_metrics(self, metrics):
        self.evaluations += 1
        return {}


class UnbuiltOptimizerTask(ProbeTask):
    def build_extras(self):
        super().build_extras()
        self.probe_optimizer = keras.optimizers.SGD(0.05)


class ForeignOptimizerTask(Task):
    """Hands gradients to an optimizer it does not hold as an attribute."""

    def build_extras(self):
        optimizers = [keras.optimizers.SGD(0.1)]
        optimizers[0].build(self.model.trainable_variables)
        self._hidden = lambda: optimizers[0]

    def apply_gradients(self, gradients, variables=None):
        super().apply_gradients(gradients, self.model.trainable_variables, optimizer=self._hidden())


class SecondModelTask(Task):
    """A second model built in build_extras: the main model's initial weights must not move."""

    def build_extras(self):
        self.other = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8)], name="other")


class CollectiveStepTask(Task):
    """Reports the global norm of the summed gradients (Task.global_norm, a collective) as a metric
    and draws per-example noise (Task.example_normal) whose sum it reports."""

    train_metrics = ("loss", "accuracy", "norm", "noise")

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            loss = replica_loss(per_example, self.global_batch, self.model.losses)
        gradients = tape.gradient(self.scale_loss(loss), self.model.trainable_variables)
        norm = self.global_norm(gradients)
        self.apply_gradients(gradients)
        # Weighted by the label, so noise drawn for the wrong example changes the sum.
        noise = self.example_normal(tf.shape(labels)[0], (3,), salt=1) * tf.cast(labels + 1, tf.float32)[:, None]
        metrics = classification_metrics(labels, logits, per_example)
        # The norm is a whole-(micro-)batch value: counted once (replica 0 only).
        first = tf.cast(tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0), tf.float32)
        return dict(metrics, norm=(norm * first, first), noise=(tf.reduce_sum(noise), metrics["loss"][1]))


class NotAClassifierTask(Task):
    """A classifier that says it is not one: no confusion matrix after evaluations."""

    is_classifier = False
