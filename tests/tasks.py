"""Tasks used by the tests (loaded with --task=tests/tasks.py:ClassName)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from engine.controller.actions.base import Action
from engine.tasks.label_smoothing import LabelSmoothingTask
from engine.tasks.language_model import LanguageModelTask
from engine.losses import per_replica_mean_loss, replica_loss
from engine.models.classifiers import cnn_bn
from engine.task import Task, classification_metrics
from examples.gan import GanTask


class PerReplicaMeanTask(Task):
    """The classic scaling mistake: each replica averages over its own examples only."""

    def train_step(self, batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            loss = per_replica_mean_loss(per_example)
        gradients = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)


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


class NotATask:
    pass


class FailOnWorkerOneTask(Task):
    """Fails on worker 1 only (as a bug in one worker's environment would)."""

    def __init__(self, config, **kwargs):
        import json
        import os

        from engine.errors import UserError

        if json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index") == 1:
            raise UserError("FailOnWorkerOneTask: worker 1 fails on purpose")
        super().__init__(config, **kwargs)


def _nan_on_last_replica_at(task, step, value=float("nan")):
    """`value` (NaN) on the last replica while global_step == step (the update to step + 1), else 1.0.
    Under MultiWorkerMirrored with 1 replica per worker, the last replica is the last worker's."""
    context = tf.distribute.get_replica_context()
    last = tf.equal(context.replica_id_in_sync_group, context.num_replicas_in_sync - 1)
    bad = tf.logical_and(last, tf.equal(task.global_step, step))
    return tf.where(bad, value, 1.0)


class NanGradientTask(Task):
    """The last replica's gradients are NaN at one step; its loss stays finite."""

    nan_at_step = 5

    def apply_gradients(self, gradients, variables=None):
        poison = _nan_on_last_replica_at(self, self.nan_at_step)
        return super().apply_gradients([g * poison for g in gradients], variables)


class NanInputTask(Task):
    """The last replica's images are NaN at one step: its activations, so the batch-norm moving
    statistics the forward pass updates, become NaN too (not only the loss and gradients)."""

    nan_at_step = 5

    def train_step(self, batch):
        images, labels = batch
        return super().train_step((images * _nan_on_last_replica_at(self, self.nan_at_step), labels))


class InfGradientTask(Task):
    """The last replica's gradients are +Inf at step 2 (as a float16 overflow on one replica would be)."""

    inf_at_step = 2

    def apply_gradients(self, gradients, variables=None):
        poison = _nan_on_last_replica_at(self, self.inf_at_step, float("inf"))
        return super().apply_gradients([g * poison for g in gradients], variables)


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


class NanLossTask(Task):
    """The last replica's per-example losses (so its loss metric and gradients) are NaN at one step.

    Eval steps see the poison too when an evaluation falls on that step: schedule around it.
    """

    nan_at_step = 5

    def per_example_loss(self, labels, outputs):
        return super().per_example_loss(labels, outputs) * _nan_on_last_replica_at(self, self.nan_at_step)


class DropoutTask(Task):
    """A small MLP with Dropout, trained on inputs with Gaussian noise drawn from Task.random_seed:
    both random ops must differ per replica and repeat with --seed."""

    def build_model(self):
        import keras

        return keras.Sequential(
            [
                keras.Input(shape=self.input_shape),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(self.num_classes, dtype="float32"),
            ],
            name="dropout_mlp",
        )

    def train_step(self, batch):
        images, labels = batch
        noise = tf.random.stateless_normal(tf.shape(images), seed=self.random_seed(), dtype=images.dtype)
        return super().train_step((images + 0.1 * noise, labels))


class QuietLabelSmoothingTask(LabelSmoothingTask):
    """The worked example without its input noise (then N replicas must train like one) and with a
    penalty strong enough that counting it once per replica would show in the weights."""

    INPUT_NOISE = 0.0
    PENALTY = 0.1


class CnnBnNoDropoutTask(Task):
    """cnn_bn without dropout (Keras draws a dropout mask per replica slice, so masks depend on the
    replica count) and with fast-moving batch-norm statistics (momentum 0.5), so that a few steps
    show whether the statistics are those of the global batch."""

    synchronized = True

    def build_model(self):
        return cnn_bn(self.input_shape, self.num_classes, dropout=0.0, momentum=0.5, synchronized=self.synchronized)


class UnsyncedCnnBnNoDropoutTask(CnnBnNoDropoutTask):
    """The same with each replica normalising by its own slice of the batch."""

    synchronized = False


class OwnDataTask(Task):
    """Brings its own pipelines (Task.datasets): 4-feature examples whose class is the sign pattern."""

    @classmethod
    def datasets(cls, config):
        from engine.data.task_data import TaskDatasets

        def examples(n, seed):
            x = tf.random.stateless_normal([n, 4], seed=[seed, 0])
            y = tf.cast(x[:, 0] > 0, tf.int32) + 2 * tf.cast(x[:, 1] > 0, tf.int32)
            return tf.data.Dataset.from_tensor_slices((x, y))

        def train(context, seed, skip_batches):
            batch = context.get_per_replica_batch_size(config.global_batch)
            local = context.num_replicas_in_sync // context.num_input_pipelines
            data = examples(512, 1).shard(context.num_input_pipelines, context.input_pipeline_id)
            data = data.shuffle(512, seed=seed).repeat().batch(batch, drop_remainder=True)
            return data.skip(skip_batches * local)

        def evaluate(context):
            batch = context.get_per_replica_batch_size(config.global_batch)
            return examples(101, 2).shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch)

        return TaskDatasets(train=train, evaluate=evaluate, num_train=512, num_test=101, num_classes=4)


class IdCountingTask(Task):
    """Evaluation returns the mean id (feature 0) of the examples it saw and the mean squared distance
    from ID_CENTRE, over their count: with the count (in-process) or both means (from the log), a test
    tells each example was evaluated exactly once (tests/test_sources.py writes such data)."""

    eval_metrics = ("mean_id", "mean_sq")
    ID_CENTRE = 1500.0

    @staticmethod
    def example_ids(x):
        return tf.cast(x[:, 0], tf.float32)

    def eval_step(self, batch):
        x, _ = batch
        ids, count = self.example_ids(x), tf.cast(tf.shape(x)[0], tf.float32)
        return {
            "mean_id": (tf.reduce_sum(ids), count),
            "mean_sq": (tf.reduce_sum(tf.square(ids - self.ID_CENTRE)), count),
        }


def _sleep_a_quarter_second():
    import time

    time.sleep(0.25)
    return 0


class SlowTrainingTask(Task):
    """The default step, 0.25 s slower: training stays running while a sidecar evaluator works."""

    def train_step(self, batch):
        with tf.control_dependencies([tf.py_function(_sleep_a_quarter_second, [], tf.int32)]):
            return super().train_step(batch)


class LocalTokenMeanTask(LanguageModelTask):
    """The per-token trap: each replica divides by its OWN real-token count (times the replica
    count, so it is right whenever every replica holds as many real tokens): a replica of mostly
    padding then weighs as much as a full one."""

    def normaliser(self, labels):
        context = tf.distribute.get_replica_context()
        local = tf.reduce_sum(tf.cast(labels >= 0, tf.float32))
        return tf.maximum(local, 1.0) * context.num_replicas_in_sync


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
        poison = _nan_on_last_replica_at(self, self.probe_poison_at)
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


def _worker_index() -> int:
    """This process's TF_CONFIG task index (0 without TF_CONFIG)."""
    import json
    import os

    return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))


class BlockingInputTask(Task):
    """The input pipeline of worker `blocked_worker` blocks once it reaches example `block_at`, as a
    hung network filesystem would, while its process stays alive (until a file 'unblock' appears in
    --model_dir)."""

    blocked_worker = 0
    block_at = 64 * 6

    def augment_example(self, features, label, seed):
        import os
        import time

        if _worker_index() != self.blocked_worker:
            return features, label
        flag = os.path.join(self.config.model_dir, "unblock")

        def wait_for_the_filesystem(position):
            if int(position) >= self.block_at:
                while not os.path.exists(flag):
                    time.sleep(0.1)
            return position

        position = tf.py_function(wait_for_the_filesystem, [seed[1]], tf.int64)
        with tf.control_dependencies([position]):
            return tf.identity(features), label


class BlockingInputOnWorkerOneTask(BlockingInputTask):
    blocked_worker = 1


class KilledOnceTask(Task):
    """Worker 1 kills itself with SIGKILL after its loop that ends at step 4, the first time only
    (a marker file in --model_dir remembers), as an OOM killer or a lost machine would."""

    def derived_metrics(self, metrics):
        import os
        import signal

        marker = os.path.join(self.config.model_dir, "killed_once")
        if _worker_index() == 1 and int(self.global_step.numpy()) >= 4 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {}


class FlipTask(Task):
    """Classification with an augmentation: each example negated or not, seeded by its stream position."""

    def augment_example(self, features, label, seed):
        flip = tf.random.stateless_uniform([], seed=seed) < 0.5
        return tf.where(flip, -features, features), label


class RecordingAction(Action):
    """Returns what it saw (after each loop: the step and loss; at the end: the keys of what the
    actions returned) and asks for a checkpoint at step 3, which no schedule would write."""

    name = "the recording action"

    def after_loop(self, context):
        if context.step == 3:
            context.request_save()
        return {"step": context.step, "loss": context.train_metrics["loss"]}

    def at_end(self, context):
        return {"step": context.step, "seen": sorted(context.outputs)}


class RecordingActionTask(Task):
    """A Task with an action of its own (RecordingAction)."""

    def actions(self):
        return [RecordingAction()]
