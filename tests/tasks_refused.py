"""Mistakes in user code that the engine must refuse up front, or end in one line without losing
the checkpoint: tests/test_cli.py, tests/test_eval.py, tests/test_update.py, tests/test_task_state.py
tests/test_examples.py and tests/test_user_code.py load them with --task=tests/tasks_refused.py:Name."""

from __future__ import annotations

import tensorflow as tf

from engine.task import Task
from examples.gan import GanTask


class NotATask:
    pass


class ModelOutsideScopeTask(Task):
    """Builds its model in __init__, outside strategy.scope(): the engine must refuse it."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self._prebuilt = super().build_model()

    def build_model(self):
        return self._prebuilt


class WrongMetricsTask(Task):
    """Returns names it did not declare."""

    def eval_step(self, batch):
        return {"loss": (tf.constant(0.0), tf.constant(1.0))}


class UnscaledLossTask(Task):
    """Forgets self.scale_loss: wrong under --precision=mixed_float16, which the engine must refuse."""

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            per_example = self.per_example_loss(labels, self.model(images, training=True))
            loss = tf.reduce_sum(per_example) / self.global_batch
        self.apply_gradients(tape.gradient(loss, self.model.trainable_variables))
        return {
            "loss": (tf.reduce_sum(per_example), tf.cast(tf.size(per_example), tf.float32)),
            "accuracy": (tf.constant(0.0), tf.cast(tf.size(per_example), tf.float32)),
        }


class FailingAfterEvalTask(Task):
    """Its after_eval (a host-side extra) raises: the run must end in one line and keep its checkpoint."""

    def after_eval(self, step, writer):
        raise ValueError("after_eval fails on purpose")


class CrashingSummariesGanTask(GanTask):
    """The GAN example whose evaluation extras crash: its training must survive in the checkpoint."""

    def after_eval(self, step, writer):
        raise RuntimeError("the summaries crash on purpose")


class GanWithoutDiscriminatorTask(GanTask):
    """The GAN example edited to drop its discriminator: resuming a GAN checkpoint must be refused."""

    def build_extras(self):
        pass


class ShapeMistakeInTrainStepTask(Task):
    """A shape mistake TensorFlow finds while tracing train_step: one line naming this file's line."""

    def train_step(self, batch):
        images, _ = batch
        tf.matmul(tf.reshape(images, [-1, 7]), tf.ones([8, 3]))  # TRAIN_STEP MISTAKE: 7 against 8
        return super().train_step(batch)


class KeyMistakeInEvalStepTask(Task):
    """eval_step returns a metric from a dict key that does not exist: found while tracing it."""

    def eval_step(self, batch):
        metrics = super().eval_step(batch)
        return {"loss": metrics["loss"], "accuracy": metrics["acuracy"]}  # EVAL_STEP MISTAKE: a typo


class EvalSummaryMistakeTask(Task):
    """eval_summary (whole-eval-set metrics) raises: a mistake of host code run after each evaluation."""

    eval_summary_metrics = ("share",)

    def eval_step(self, batch):
        self.collect("labels", batch[1])
        return super().eval_step(batch)

    def eval_summary(self, collected):
        labels = collected["labels"]
        return {"share": float(labels.sum()) / labels.nmbr}  # EVAL_SUMMARY MISTAKE: a typo


class UnservableModelTask(Task):
    """export_model gives a model whose call works only eagerly (the serving signature fails)."""

    def export_model(self):
        import keras

        class EagerOnly(keras.Model):
            def call(self, images):
                return tf.constant(images.numpy())  # EXPORT MISTAKE: .numpy() in a traced call

        return EagerOnly()
