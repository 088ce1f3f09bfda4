"""The researcher's extension point: what ONE replica does with one batch.

Subclass `Task`, override `train_step` (and maybe `build_model`, `per_example_loss`,
`eval_step`), then run it with `--task=my_module:MyTask` (or `--task=path/to/file.py:MyTask`).

`train_step` and `eval_step` run in replica context, inside a compiled loop: use TensorFlow ops,
`self.model` and `self.optimizer`. The engine creates both inside `strategy.scope()`, builds the
optimizer, compiles the loop, reduces what the steps return across replicas, logs, evaluates and
checkpoints.

A Task may hold more than one model: other models, optimizers, frozen teachers and variables
created in `build_extras()` and kept as attributes are checkpointed automatically, and each
optimizer handed gradients with `apply_gradients(..., optimizer=...)` gets the engine's update.
docs/examples.md shows SAM, distillation, a gradient penalty and a GAN.

Metrics are returned, not stored: a step returns {name: (total, count)} for this replica's
examples, e.g. {"accuracy": (number correct, number of examples)}. The engine sums totals and
counts over replicas (strategy.reduce(SUM)) and over the steps of a loop, and reports
total / count. That is exact for any replica count and for a partial last eval batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from engine import step_context, update
from engine.data.spec import DataSpec
from engine.errors import UserError
from engine.losses import replica_loss
from engine.models.registry import build_model
from engine.optimizers import build_optimizer
from engine.randomness import replica_seed


def classification_metrics(labels, logits, per_example_loss) -> dict:
    """{"loss": (sum of losses, n), "accuracy": (number correct, n)} for this replica's batch."""
    count = tf.cast(tf.shape(labels)[0], tf.float32)
    predictions = tf.argmax(logits, axis=-1, output_type=labels.dtype)
    correct = tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32))
    loss_sum = tf.reduce_sum(tf.cast(per_example_loss, tf.float32))
    return {"loss": (loss_sum, count), "accuracy": (correct, count)}


class Task:
    """Image classification with the `--model` network and sparse cross-entropy."""

    # The names train_step / eval_step return, in this order.
    train_metrics = ("loss", "accuracy")
    eval_metrics = ("loss", "accuracy")
    # The names eval_summary returns (whole-eval-set scalars such as "auc"): declared, they are
    # valid --best_metric names from start-up on (and checked against what eval_summary returns).
    eval_summary_metrics = ()
    # The model maps the data's features to one logit per class: the engine then draws confusion
    # matrices and misclassified examples after each evaluation. Set False for other models (a GAN).
    is_classifier = True
    # A model with several outputs: the one holding the class logits (an index, an output layer's
    # name or a dict key) for the confusion matrix and the pictures; None: pictures off for it.
    classifier_output = None

    # Optional: a staticmethod (serialized tf.train.Example) -> (features, label) for
    # --dataset=tfrecord:... files not in the default schema; it runs before the Task exists (its
    # output decides `spec`). See engine/data/tfrecord.py.
    parse_example = None

    @classmethod
    def datasets(cls, config):
        """Override to bring your own tf.data pipelines: return an engine.data.task_data.TaskDatasets
        (its docstring has a complete example); None (the default) uses --dataset."""
        return None

    def __init__(self, config, spec: DataSpec | None = None, *, input_shape=None, num_classes=None):
        """`spec`: the data's per-example shapes and dtypes and its classes (the engine passes the
        source's). `input_shape`/`num_classes` are a short form for classification data."""
        self.config = config
        if spec is None:
            if input_shape is None:
                raise TypeError("Task needs the data's spec (or input_shape and num_classes)")
            spec = DataSpec.classification(input_shape, num_classes)
        self.spec = spec
        self.model: keras.Model | None = None  # set by the engine, inside strategy.scope()
        self.optimizer: keras.optimizers.Optimizer | None = None  # idem, already built
        # Set by the engine: steps (global batches) trained so far, a tf.Variable readable in a step.
        self.global_step: tf.Variable | None = None
        self.updater: update.Updater | None = None  # set by the engine: applies handed-over gradients
        # Set by the engine before build_optimizer(): the run's total optimizer updates (schedules).
        self.total_steps: int | None = None
        self.seed: int | None = None  # set by the engine: the run's seed (a resumed run's own)

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    @property
    def input_shape(self) -> tuple:
        return self.spec.input_shape

    @property
    def num_classes(self):
        return self.spec.num_classes

    # ---- built once by the engine, inside strategy.scope() ----
    def build_model(self) -> keras.Model:
        if not self.num_classes or self.spec.labels.shape.rank != 0:
            raise UserError(
                f"--task={self.config.task} classifies, but the data's labels are {self.spec.labels.dtype.name} "
                f"{tuple(self.spec.labels.shape)} (not one class id per example); use a Task of your own "
                "(--task=path/to/file.py:Class) for other targets"
            )
        return build_model(self.config.model, self.input_shape, self.num_classes, spec=self.spec)

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        return build_optimizer(self.config, self.total_steps)

    def build_extras(self) -> None:
        """Create the Task's other state here, as attributes: more models, optimizers (build each:
        `opt.build(variables)`), frozen models (`self.load_frozen(...)`), tf.Variables. Runs inside
        strategy.scope() after self.model and self.optimizer exist, so adding a model here never
        changes the main model's initial weights. Everything reachable from the Task's attributes
        (lists and dicts too) is checkpointed and restored on resume; a resume from a checkpoint
        with an attribute more or less is refused. Default: nothing."""

    def load_frozen(self, model_or_path) -> keras.Model:
        """A model that is never trained (a teacher): a keras.Model or the path of a `.keras` file,
        returned with trainable=False. Call it in build_extras and keep it as an attribute (it is
        checkpointed with the Task)."""
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            try:
                model_or_path = keras.models.load_model(model_or_path, compile=False)
            except (OSError, ValueError) as err:
                raise UserError(f"cannot load the frozen model {model_or_path}: {str(err).splitlines()[0]}") from None
        model_or_path.trainable = False
        return model_or_path

    # ---- in the input pipeline (tf.data, per example) ----
    def augment_example(self, features, label, seed):
        """Training augmentation of ONE example (override it; the default changes nothing and costs
        nothing). `seed` is a [2] int64 seed for tf.random.stateless_* ops: different for every
        example and epoch, the same when the run repeats with --seed or resumes. Evaluation data is
        never augmented. Return any structure of tensors (the pair, two views stacked as (2, H, W, C),
        a tuple, a dict, another size or label dtype): `train_step` gets it batched, each tensor of one
        fixed shape for every example (anything else is refused at start-up). `input_shape`, the
        model, evaluation and the export keep the data's own example."""
        return features, label

    def example_augmentation(self, seed: int):
        """(features, label, stream position) -> augmented example, for the training pipeline; None
        when this Task does not override `augment_example` (the pipeline then maps nothing). Its seed
        [run seed, position] differs per example and per epoch (a position is never reused) and
        repeats with --seed and after a resume."""
        if type(self).augment_example is Task.augment_example:
            return None

        def augment(features, label, position):
            return self.augment_example(features, label, tf.stack([tf.constant(seed, tf.int64), position]))

        augment.where = f"{type(self).__name__}.augment_example"  # what a refusal names
        return augment

    # ---- replica context ----
    def per_example_loss(self, labels, outputs):
        # float32 even when a mixed-precision model's last layer computes in float16/bfloat16.
        return keras.losses.sparse_categorical_crossentropy(labels, tf.cast(outputs, tf.float32), from_logits=True)

    def train_step(self, batch) -> dict:
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            per_example = self.per_example_loss(labels, logits)
            loss = replica_loss(per_example, self.global_batch, self.model.losses)
            scaled_loss = self.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled_loss, self.model.trainable_variables))
        return classification_metrics(labels, logits, per_example)

    def scale_loss(self, loss):
        """The loss to differentiate: times the dynamic loss scale under --precision=mixed_float16
        (small float16 gradients would otherwise flush to zero), else the loss itself. The engine
        divides the gradients by the same scale after summing them."""
        return self.updater.scale(loss) if self.updater is not None else loss

    def apply_gradients(self, gradients, variables=None, *, optimizer=None, when=None):
        """Hands this replica's gradients (of self.scale_loss(loss)) to the engine, once per
        optimizer and step.

        After train_step returns, the engine sums the gradients of every optimizer over
        micro-batches (--grad_accum_steps) and over ALL replicas and workers (one all-reduce),
        unscales them, checks them all for NaN/Inf (a bad step leaves every model's weights and
        every optimizer's state untouched; --on_nonfinite says whether the run stops), clips each
        optimizer's global norm (--clip_norm) and applies them: every update sees the pre-step weights.

        optimizer: None for self.optimizer, or another optimizer the Task holds (see build_extras);
          then `variables` is required. `variables` defaults to the model's trainable variables.
        when: a scalar bool, the same on every replica (compute it from self.global_step, never from
          data): the optimizer steps only where it is True, e.g. `when=self.global_step % 2 == 0`.
          The gradients are all-reduced every step, so no collective ever runs inside a cond.
        (Calling self.optimizer.apply_gradients yourself also works, without those guarantees.)
        """
        if variables is None:
            if optimizer is not None and optimizer is not self.optimizer:
                raise UserError("self.apply_gradients(optimizer=...) needs the variables it updates")
            variables = self.model.trainable_variables
        step_context.hand_over(gradients, variables, None if optimizer is self.optimizer else optimizer, when)

    def all_reduce(self, value):
        """SUM of a tensor (or a list of them) over every replica and worker, inside train_step: the
        one safe way for a step to see a cross-replica value (a raw merge_call is not). It works with
        --grad_accum_steps (the micro-batches then run unrolled); with --jit_compile under a mirrored
        strategy the step is refused with one line."""
        return step_context.all_reduce(value)

    def all_gather(self, value, axis=0):
        """Every replica's and worker's `value` (a tensor of rank >= 1, or a list of them)
        concatenated along `axis` in replica order, the same on every replica, inside train_step or
        eval_step: e.g. the whole global batch's embeddings for a contrastive loss. In training this
        replica's rows start at replica_id_in_sync_group x its batch size (training batches are
        whole). Each value is sent once (a gather, not a padded all-reduce); the gradient reaching
        this replica's value is the upstream gradient summed over replicas, sliced to its own rows.
        With --grad_accum_steps each micro-batch gathers its own rows (the micro-batches then run
        unrolled); with --jit_compile under a mirrored strategy the step is refused with one line."""
        return step_context.all_gather(value, axis)

    def global_norm(self, gradients):
        """The global norm of `gradients` summed over every replica (one all-reduce of them): what
        the engine's clipping and grad_norm summary see for a whole (micro-)batch."""
        return tf.linalg.global_norm(
            step_context.all_reduce([tf.cast(g, tf.float32) for g in gradients if g is not None], "self.global_norm")
        )

    def random_seed(self, salt=0):
        """A [2] int32 seed for tf.random.stateless_* ops in a step: differs per replica and per
        step, repeats with --seed. Use a different `salt` for each independent draw in one step."""
        return replica_seed(self.seed, self.global_step, salt)

    def example_seeds(self, n, salt=0):
        """[n, 2] int64 seeds, one per example of this replica's batch, from (--seed, step, salt, and
        in train_step the example's index in the GLOBAL batch, in eval_step a fingerprint of the
        example's tensors): per-example noise that is the same whatever the replica count, worker
        count or --grad_accum_steps (in evaluation also the batch size; identical examples get
        identical noise). `n`: this replica's batch size."""
        return step_context.example_seeds(replica_seed(self.seed, self.global_step, salt, per_replica=False), n)

    def example_normal(self, n, shape, salt=0):
        """[n, *shape] float32 standard-normal noise, each example's drawn from its example_seeds
        (e.g. a GAN's latent vectors)."""
        seeds = self.example_seeds(n, salt)
        return tf.map_fn(
            lambda seed: tf.random.stateless_normal(tuple(shape), seed), seeds, fn_output_signature=tf.float32
        )

    def eval_step(self, batch) -> dict:
        images, labels = batch
        logits = self.model(images, training=False)
        return classification_metrics(labels, logits, self.per_example_loss(labels, logits))

    def collect(self, name, tensor):
        """Inside eval_step: hands this replica's per-example `tensor` (leading axis: the examples
        of its batch, e.g. logits [n, classes] or labels [n]) to the host under `name`. After each
        evaluation `eval_summary` gets every eval example's rows exactly once, in the eval set's
        order. The whole set's arrays are held in host memory (docs/evaluation.md); multi-worker
        training refuses it at start-up (evaluate with a sidecar or --mode=eval instead)."""
        step_context.collect(name, tensor)

    @property
    def micro_batch(self):
        """Inside train_step: which micro-batch of the update this step is on, 0 to
        --grad_accum_steps - 1 (an int, or an int32 scalar inside the engine's micro-batch loop);
        0 without accumulation. E.g. where to keep this micro-batch's keys until after_update."""
        return step_context.micro_batch()

    def after_update(self) -> None:
        """Runs once after each optimizer update, on every replica, after the engine applied the
        summed gradients, and only when it did (not for a skipped non-finite step or a float16
        loss-scale overflow): however many micro-batches --grad_accum_steps splits the batch into,
        it runs once. For state that moves once per update: a momentum encoder, a queue of keys, a
        target network. Assignments are per replica: compute them from values the same on every
        replica (the weights, what train_step gathered into a variable). No collectives here (it
        runs under a tf.cond): gather in train_step. Default: nothing."""

    # ---- on the host, between compiled loops ----
    def eval_summary(self, collected: dict) -> dict:
        """Whole-eval-set metrics, after each evaluation: `collected` is {name: NumPy array} of what
        eval_step handed to self.collect, every eval example once in the eval set's order (the
        partial last batch included). Return {name: scalar} (e.g. AUC, macro-F1): printed with the
        eval metrics, written to TensorBoard, and a --best_metric / early-stopping metric once
        listed in `eval_summary_metrics`. Plain Python/NumPy on the host. Default: none."""
        return {}

    def derived_metrics(self, metrics: dict) -> dict:
        """Values computed from a loop's or an evaluation's reduced ratios {name: total / count}
        that are not ratios themselves (e.g. perplexity = exp(loss)); the engine shows them with the
        others (console, TensorBoard, the run's result). Plain Python on the host. Default: none."""
        return {}

    def actions(self) -> list:
        """Host-side work of your own at known points of the run: engine/controller/actions/base.py
        `Action` objects (after_loop, after_eval, at_end, each given an ActionContext), run after the
        engine's. Default: none."""
        return []

    def export_model(self) -> keras.Model:
        """What the export writes (export/model.keras, the SavedModel, best/model.keras): the main
        model by default; e.g. a GAN's generator only."""
        return self.model

    def after_eval(self, step: int, writer) -> None:
        """Called after each evaluation on the chief only (with --summaries=full), with the eval
        run's SummaryWriter (engine/observe/summaries.py: write_figure for a matplotlib figure from
        engine.observe.figures.new_figure, write_text, write_images, write_scalars).
        Runs on the host, outside any compiled loop: call self.model directly (its local copy of the
        weights), never a collective or strategy.run (other workers do not call it). Default: nothing."""


ClassificationTask = Task
