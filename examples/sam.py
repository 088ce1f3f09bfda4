"""Sharpness-aware minimisation (Foret et al., 2021) as a Task: the gradient is taken at the worst
nearby weights w + e, e = rho * g / ||g||, then applied at w.

    python run.py --task=examples/sam.py:SamTask --model=cnn --dataset=fashion_mnist

Shows: a step-level collective from the engine (`self.all_reduce`: e uses the gradient summed over
every replica, so every replica perturbs its copy of the weights alike), in-step assignment (per
replica, identical here because e is), and that --grad_accum_steps works with it (each micro-batch
is perturbed by its own gradient; the engine runs the micro-batches unrolled).
"""

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class SamTask(Task):
    rho = 0.05  # radius of the neighbourhood

    def loss(self, images, labels):
        logits = self.model(images, training=True)
        per_example = self.per_example_loss(labels, logits)
        return replica_loss(per_example, self.global_batch, self.model.losses), logits, per_example

    def train_step(self, batch):
        images, labels = batch
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss, _, _ = self.loss(images, labels)
        gradients = self.all_reduce(tape.gradient(loss, variables))  # the whole batch's gradient
        scale = self.rho / (tf.linalg.global_norm(gradients) + 1e-12)
        steps = [g * scale for g in gradients]
        for variable, e in zip(variables, steps):
            variable.assign_add(e)  # the same on every replica: e comes from summed values
        with tf.GradientTape() as tape:
            loss, logits, per_example = self.loss(images, labels)
            scaled = self.scale_loss(loss)
        sharp_gradients = tape.gradient(scaled, variables)
        for variable, e in zip(variables, steps):
            variable.assign_sub(e)
        self.apply_gradients(sharp_gradients)  # applied at w, like any step's
        return classification_metrics(labels, logits, per_example)
