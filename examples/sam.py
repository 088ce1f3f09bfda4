"""Sharpness-aware minimisation (SAM, Foret et al., 2021) as a Task: take the gradient at the worst
nearby weights w + e, e = rho * g / ||g|| (g: the whole global batch's gradient at w), and apply it
to w.

    python run.py --task=examples/sam.py:SamTask --model=cnn --dataset=fashion_mnist \
        --strategy=mirrored --cpu_replicas=2

Shows: a collective inside the step from the engine (`self.all_reduce`: g is summed over every
replica, so every replica moves its copy of the weights by the same e), in-step assignment (per
replica: identical on every replica only because e is computed from summed values), a guard that
keeps a non-finite g from writing NaN into the weights behind the engine's finite check, and that
--grad_accum_steps works (each micro-batch is perturbed by its own gradient; the engine then runs
the micro-batches unrolled; --jit_compile under a mirrored strategy is refused, as XLA cannot hold
the collective). Two forward passes per step: about twice the cost of a plain step.
With batch norm, both passes move the moving statistics.
"""

import tensorflow as tf

from engine.losses import replica_loss
from engine.task import Task, classification_metrics


class SamTask(Task):
    rho = 0.05  # radius of the neighbourhood

    def forward(self, images, labels):
        logits = self.model(images, training=True)
        per_example = self.per_example_loss(labels, logits)
        loss = replica_loss(per_example, self.global_batch, self.model.losses)
        return self.scale_loss(loss), logits, per_example

    def train_step(self, batch):
        images, labels = batch
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            scaled, _, _ = self.forward(images, labels)
        # The loss scale (mixed_float16) cancels in g / ||g||, so the scaled gradient serves as it is.
        g = self.all_reduce(tape.gradient(scaled, variables))  # summed over every replica
        norm = tf.linalg.global_norm(g)
        # A non-finite g (a float16 overflow, a bad batch) must not reach the weights: assign_sub of
        # NaN does not undo assign_add of NaN. norm is the same on every replica, so is the choice.
        finite = tf.math.is_finite(norm)
        e = [tf.where(finite, self.rho / (norm + 1e-12) * x, tf.zeros_like(x)) for x in g]
        for v, step in zip(variables, e):
            v.assign_add(step)  # w + e, on each replica's copy
        with tf.GradientTape() as tape:
            scaled, logits, per_example = self.forward(images, labels)
        sharp = tape.gradient(scaled, variables)
        for v, step in zip(variables, e):
            v.assign_sub(step)  # back to w
        self.apply_gradients(sharp)  # the gradient at w + e, applied to w by the engine
        return classification_metrics(labels, logits, per_example)
