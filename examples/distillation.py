"""Knowledge distillation from a frozen teacher (Hinton et al., 2015) as a Task.

    TEACHER_MODEL=runs/teacher/export/model.keras \
    python run.py --task=examples/distillation.py:DistillationTask --model=mlp --dataset=fashion_mnist

Shows: a frozen model held by the Task (`self.load_frozen`, in `build_extras`): checkpointed with
the run, never updated. Without TEACHER_MODEL the teacher is a freshly initialised `--model`
network, frozen: only for trying the Task out.
"""

import os

import keras
import tensorflow as tf

from engine.losses import replica_loss
from engine.models.registry import build_model
from engine.task import Task, classification_metrics


class DistillationTask(Task):
    temperature = 4.0
    alpha = 0.7  # weight of the teacher's soft targets; 1 - alpha for the labels
    train_metrics = ("loss", "accuracy", "distill")

    def build_extras(self):
        path = os.environ.get("TEACHER_MODEL")
        teacher = path or build_model(self.config.model, self.input_shape, self.num_classes, spec=self.spec)
        self.teacher = self.load_frozen(teacher)

    def train_step(self, batch):
        images, labels = batch
        t = self.temperature
        soft_targets = tf.nn.softmax(tf.cast(self.teacher(images, training=False), tf.float32) / t)
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            hard = self.per_example_loss(labels, logits)
            soft = keras.losses.kl_divergence(soft_targets, tf.nn.softmax(tf.cast(logits, tf.float32) / t)) * t * t
            per_example = self.alpha * soft + (1 - self.alpha) * hard
            loss = self.scale_loss(replica_loss(per_example, self.global_batch, self.model.losses))
        self.apply_gradients(tape.gradient(loss, self.model.trainable_variables))
        metrics = classification_metrics(labels, logits, hard)
        return dict(metrics, distill=(tf.reduce_sum(soft), metrics["loss"][1]))
