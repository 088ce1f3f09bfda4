"""Everything a run trains and checkpoints, built inside strategy.scope(), and its restore.

The Task's model, its optimizer (built before the first traced step: invariant 1), the Task's
other state (models, optimizers, variables it holds as attributes: engine/task_state.py, built by
Task.build_extras) and the engine's updater, plus the run's counters: global_step (steps trained),
epoch and the seed. The checkpoint also holds the loss scale (mixed_float16) and the random layers'
seed states, so a resumed run continues exactly where it stopped. A checkpoint whose Task state
differs from the Task's (an attribute more or less) is refused, never half restored (invariant 11).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import keras
import tensorflow as tf

from engine import refused_combinations, task_state
from engine.distribute import strategy as strategy_lib
from engine.controller.checkpoints import Checkpointer
from engine.optimizers import constant_rate
from engine.randomness import per_replica_randomness, seed_generators
from engine.ema import WeightAverage
from engine.errors import UserError
from engine.update import Updater

TASK_NODE = "task"  # the checkpoint's node for the Task's own state (attribute path -> object)


def build_task(strategy, task) -> task_state.TaskState:
    """Inside strategy.scope(): the Task's model, its optimizer (built), its extras
    (Task.build_extras) and the engine's updater, every variable checked to be in the scope.
    Returns the Task's own state (what the checkpoint holds besides the model and optimizer)."""
    task.model = task.build_model()
    refused_combinations.check(task.config, task.model)  # refused flag combinations, before any trace
    per_replica_randomness(task.model)  # Dropout & co. draw differently on each replica
    strategy_lib.check_variables_in_scope(strategy, task.model.variables)
    task.optimizer = task.build_optimizer()
    task.optimizer.build(task.model.trainable_variables)
    strategy_lib.check_variables_in_scope(strategy, task.optimizer.variables)
    task.build_extras()  # after the main model: an extra model never moves its initial weights
    extras = task_state.find(task)
    for model in extras.models.values():
        if isinstance(model, keras.Model) or model.weights:
            refused_combinations.check(task.config, model)
            per_replica_randomness(model)
            strategy_lib.check_variables_in_scope(strategy, model.variables)
    for path, optimizer in extras.optimizers.items():
        if not optimizer.built:
            raise UserError(
                f"the Task's optimizer self.{path} is not built: in build_extras(), call "
                f"self.{path}.build(variables) with the variables it will update"
            )
        strategy_lib.check_variables_in_scope(strategy, optimizer.variables)
    ema = WeightAverage(task.model, task.config.ema_decay) if task.config.ema_decay else None
    task.updater = Updater(
        task.optimizer,
        loss_scaling=task.config.precision == "mixed_float16",
        clip_norm=task.config.clip_norm,
        optimizers=extras.optimizers,
        ema=ema,
        guarded=task.config.on_nonfinite != "stop",
    )
    return extras


def trained_models(task, extras: task_state.TaskState) -> list:
    """The main model and every extra model that trains (a frozen one's state never changes)."""
    return [task.model] + [model for model in extras.models.values() if model.trainable and model is not task.model]


def check_task_state(extras: task_state.TaskState, path: str) -> None:
    """Refuses (one line) a checkpoint whose Task state has an attribute more or less than the Task."""
    held = task_state.top_level_names(path, TASK_NODE)
    has = set(extras.trackables)
    missing, unknown = sorted(has - held), sorted(held - has)
    if missing:
        raise UserError(
            f"checkpoint {path} lacks the Task's self.{missing[0]} (it would start from scratch, not "
            "resume); resume with the Task that wrote it, or use a new --model_dir"
        )
    if unknown:
        raise UserError(
            f"checkpoint {path} holds self.{unknown[0]}, which this Task does not have; resume with "
            "the Task that wrote it, or use a new --model_dir"
        )


def check_dropped_state(config, path: str) -> None:
    """Refuses (one line) a resume without --on_nonfinite=rollback from a checkpoint whose data
    position rollbacks moved: only rollback's counters hold it, so the run would replay batches."""
    if config.on_nonfinite == "rollback":
        return
    reader = tf.train.load_checkpoint(path)
    key = "data_offset/.ATTRIBUTES/VARIABLE_VALUE"
    offset = int(reader.get_tensor(key)) if reader.has_tensor(key) else 0
    if offset:
        raise UserError(
            f"--on_nonfinite={config.on_nonfinite}: checkpoint {path} was written after rollbacks moved "
            f"its data {offset} batches past bad steps, which only --on_nonfinite=rollback keeps; resume "
            "with --on_nonfinite=rollback (--max_rollbacks=0 makes the next bad step stop the run)"
        )


def _verify(config, extras: task_state.TaskState, path: str) -> None:
    check_task_state(extras, path)
    check_dropped_state(config, path)


# What a resume says when its checkpoint lacks the state a flag added (Checkpointer's `optional`).
INITIALISED = {
    "ema": "--ema_decay={decay}: checkpoint {path} holds no weight averages; they start from its weights (step {step})",
    "data_offset": "--on_nonfinite=rollback: checkpoint {path} holds no rollback counters; they start at 0 "
    "(no rollback made, no batch skipped)",
}


def _counter(name, value=0):
    return tf.Variable(
        value, dtype=tf.int64, trainable=False, name=name, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
    )


@dataclasses.dataclass
class TrainState:
    task: object
    global_step: tf.Variable
    epoch: tf.Variable
    seed: tf.Variable
    checkpointer: Checkpointer
    extras: task_state.TaskState
    # Batches skipped past bad steps by rollbacks (the data position is global_step + data_offset),
    # and how many rollbacks the run made: both checkpointed.
    data_offset: tf.Variable
    rollbacks: tf.Variable
    warned: set = dataclasses.field(default_factory=set)  # untracked attributes already reported
    initialised_lines: list = dataclasses.field(default_factory=list)  # state a resume started afresh, said

    @property
    def data_position(self) -> int:
        """Global batches the data has delivered to the weights' state: steps plus those skipped by rollbacks."""
        return self.step + int(self.data_offset.numpy())

    @property
    def models(self) -> list:
        return trained_models(self.task, self.extras)

    @property
    def step(self) -> int:
        return int(self.global_step.numpy())

    def restore(self) -> str | None:
        """Restores the latest checkpoint (None: a fresh run). This run's constant --learning_rate
        wins over the one the checkpoint holds; a resumed run keeps its seed (re-seeding Keras)."""
        optimizer = self.task.optimizer
        configured_rate = constant_rate(optimizer)
        path = self.checkpointer.restore_latest()
        self.initialised_lines = [
            "resume       "
            + INITIALISED[name].format(decay=self.task.config.ema_decay, path=os.path.basename(path), step=self.step)
            for name in self.checkpointer.initialised
            if name in INITIALISED and path
        ]
        if configured_rate is not None:
            optimizer.learning_rate = configured_rate
        if int(self.seed.numpy()) != self.task.seed:  # a resumed run keeps its seed, so its data order
            self.task.seed = int(self.seed.numpy())
            keras.utils.set_random_seed(self.task.seed)  # and other randomness (initialisers) follows it
        return path

    def save(self, step: int, epoch: int) -> str:
        self.epoch.assign(epoch)
        return self.checkpointer.save(step)

    def untracked_warnings(self) -> list[str]:
        """One line per Task attribute that changed during training but that no checkpoint holds
        (each reported once): a resumed run would start it again from its first value."""
        lines = []
        for path in self.extras.changed_untracked(self.task):
            if path not in self.warned:
                self.warned.add(path)
                kind = type(self.extras.untracked[path]).__name__
                lines.append(
                    f"warning: self.{path} ({kind}) changed during training, but no checkpoint can hold "
                    "it: a resumed run starts it from its first value; keep it in a tf.Variable "
                    "(created in build_extras)"
                )
        return lines


def create_state(
    strategy, task, *, seed: int, model_dir: str, is_chief: bool, keep: int, writable: bool = True
) -> TrainState:
    with strategy.scope():
        extras = build_task(strategy, task)
        global_step, epoch, seed_variable = _counter("global_step"), _counter("epoch"), _counter("seed", seed)
        data_offset, rollbacks = _counter("data_offset"), _counter("rollbacks")
    task.global_step, task.seed = global_step, seed
    own_state = {TASK_NODE: tf.train.Checkpoint(**extras.trackables)} if extras.trackables else {}
    models = [task.model] + [model for model in extras.models.values() if model is not task.model]
    checkpointer = Checkpointer(
        model_dir,
        is_chief,
        keep,
        writable=writable,
        verify=functools.partial(_verify, task.config, extras),
        optional=_optional_state(task, data_offset, rollbacks),
        model=task.model,
        optimizer=task.optimizer,
        global_step=global_step,
        epoch=epoch,
        seed=seed_variable,
        **task.updater.checkpoint_items(),
        **own_state,
        **({"data_offset": data_offset, "rollbacks": rollbacks} if task.config.on_nonfinite == "rollback" else {}),
        # Dropout & co.: a resumed run continues their random streams instead of restarting them.
        random_states=[generator.state.value for model in models for generator in seed_generators(model)],
    )
    return TrainState(
        task=task,
        global_step=global_step,
        epoch=epoch,
        seed=seed_variable,
        checkpointer=checkpointer,
        extras=extras,
        data_offset=data_offset,
        rollbacks=rollbacks,
    )


def _optional_state(task, data_offset, rollbacks) -> dict:
    """{checkpoint name: initialise} of the state a flag adds, which a checkpoint written without
    that flag lacks: the EMA's averages start from the restored weights, rollback's counters at 0."""
    optional = {}
    ema = task.updater.ema
    if ema is not None:
        optional.update(ema=ema.start_from_weights, ema_updates=ema.start_from_weights)
    if task.config.on_nonfinite == "rollback":

        def zero():
            data_offset.assign(0)
            rollbacks.assign(0)

        optional.update(data_offset=zero, rollbacks=zero)
    return optional


def build_task_state(config, placement, task_class, data, *, seed: int, total_steps: int, writable: bool = True):
    """The Task and its TrainState (model, built optimizer, updater, counters) in strategy.scope().
    writable=False: a checkpoint that only reads (an evaluator never saves into the run)."""
    task = task_class(config, spec=data.spec)
    task.total_steps = total_steps
    state = create_state(
        placement.strategy,
        task,
        seed=seed,
        model_dir=config.model_dir,
        is_chief=placement.is_chief,
        keep=config.keep_checkpoints,
        writable=writable,
    )
    return task, state
