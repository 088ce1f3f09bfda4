"""Knowledge distillation from a frozen teacher (Hinton et al., 2015) as a Task.

    python run.py --model=cnn --dataset=fashion_mnist --model_dir=runs/teacher    # train a teacher
    TEACHER_MODEL=runs/teacher/export/model.keras \
    python run.py --task=examples/distillation.py:DistillationTask --model=mlp --dataset=fashion_mnist

Shows: a frozen model held by the Task (`self.load_frozen` in `build_extras`: checkpointed with the
run, never updated), and a loss of two parts through `replica_loss`, per example:
alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy, where _T is the softmax of
logits / T. The teacher may be another architecture than the student (`--model`).

Without TEACHER_MODEL the teacher is a freshly initialised `--model` network (initialised from the
run's --seed, after the student), frozen: only for trying the Task out, it teaches nothing.
"""

import os

import tensorflow as tf

from engine.losses import replica_loss
from engine.models.registry import build_model
from engine.task import Task, classification_metrics


class DistillationTask(Task):
    temperature = 4.0  # T
    alpha = 0.7  # weight of the teacher's soft targets; 1 - alpha for the labels
    train_metrics = ("loss", "accuracy", "distill")  # distill: T^2 * KL, per example

    def build_extras(self):
        path = os.environ.get("TEACHER_MODEL")
        teacher = path or build_model(self.config.model, self.input_shape, self.num_classes, spec=self.spec)
        self.teacher = self.load_frozen(teacher)  # trainable=False, checkpointed as task/teacher

    def distillation_loss(self, labels, logits, teacher_logits):
        """(per-example loss, its distillation part T^2 * KL, its cross-entropy part)."""
        t = self.temperature
        teacher_log_p = tf.nn.log_softmax(tf.cast(teacher_logits, tf.float32) / t)
        student_log_p = tf.nn.log_softmax(tf.cast(logits, tf.float32) / t)
        kl = tf.reduce_sum(tf.exp(teacher_log_p) * (teacher_log_p - student_log_p), axis=-1)
        distill = t * t * kl  # T^2 keeps its gradients' size independent of T
        hard = self.per_example_loss(labels, logits)
        return self.alpha * distill + (1 - self.alpha) * hard, distill, hard

    def train_step(self, batch):
        images, labels = batch
        teacher_logits = self.teacher(images, training=False)  # outside the tape: a constant
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example, distill, hard = self.distillation_loss(labels, logits, teacher_logits)
            loss = replica_loss(per_example, self.global_batch, self.model.losses)
            scaled = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled, self.model.trainable_variables))
        metrics = classification_metrics(labels, logits, hard)  # loss: the cross-entropy
        return dict(metrics, distill=(tf.reduce_sum(distill), metrics["loss"][1]))
