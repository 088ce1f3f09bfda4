"""Everything a run trains and checkpoints, built inside strategy.scope(), and its restore.

The Task's model, its optimizer (built before the first traced step: invariant 1) and the
engine's updater, plus the run's counters: global_step (steps trained), epoch and the seed. The
checkpoint also holds the loss scale (mixed_float16) and the random layers' seed states, so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from engine import refused_combinations
from engine.distribute import strategy as strategy_lib
from engine.controller.checkpoints import Checkpointer
from engine.optimizers import constant_rate
from engine.randomness import per_replica_randomness, seed_generators
from engine.update import Updater


def build_task(strategy, task) -> None:
    """Inside strategy.scope(): the Task's model, its optimizer (built) and the engine's updater,
    every variable checked to be in the scope."""
    task.model = task.build_model()
    refused_combinations.check(task.config, task.model)  # refused flag combinations, before any trace
    per_replica_randomness(task.model)  # Dropout & co. draw differently on each replica
    strategy_lib.check_variables_in_scope(strategy, task.model.variables)
    task.optimizer = task.build_optimizer()
    task.optimizer.build(task.model.trainable_variables)
    strategy_lib.check_variables_in_scope(strategy, task.optimizer.variables)
    task.updater = Updater(task.optimizer, loss_scaling=task.config.precision == "mixed_float16",
                           clip_norm=task.config.clip_norm)


def _counter(name, value=0):
    return tf.Variable(value, dtype=tf.int64, trainable=False, name=name,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


@dataclasses.dataclass
class TrainState:
    task: object
    global_step: tf.Variable
    epoch: tf.Variable
    seed: tf.Variable
    checkpointer: Checkpointer

    @property
    def step(self) -> int:
        return int(self.global_step.numpy())

    def restore(self) -> str | None:
        """Restores the latest checkpoint (None: a fresh run). This run's constant --learning_rate
        wins over the one the checkpoint holds; a resumed run keeps its seed (re-seeding Keras)."""
        optimizer = self.task.optimizer
        configured_rate = constant_rate(optimizer)
        path = self.checkpointer.restore_latest()
        if configured_rate is not None:
            optimizer.learning_rate = configured_rate
        if int(self.seed.numpy()) != self.task.seed:  # a resumed run keeps its seed, so its data order
            self.task.seed = int(self.seed.numpy())
            keras.utils.set_random_seed(self.task.seed)  # and other randomness (initialisers) follows it
        return path

    def save(self, step: int, epoch: int) -> str:
        self.epoch.assign(epoch)
        return self.checkpointer.save(step)


def create_state(strategy, task, *, seed: int, model_dir: str, is_chief: bool, keep: int,
                 writable: bool = True) -> TrainState:
    with strategy.scope():
        build_task(strategy, task)
        global_step, epoch, seed_variable = _counter("global_step"), _counter("epoch"), _counter("seed", seed)
    task.global_step, task.seed = global_step, seed
    checkpointer = Checkpointer(
        model_dir, is_chief, keep, writable=writable,
        model=task.model, optimizer=task.optimizer, global_step=global_step, epoch=epoch, seed=seed_variable,
        **task.updater.checkpoint_items(),
        # Dropout & co.: a resumed run continues their random streams instead of restarting them.
        random_states=[generator.state.value for generator in seed_generators(task.model)],
    )
    return TrainState(task=task, global_step=global_step, epoch=epoch, seed=seed_variable, checkpointer=checkpointer)


def build_task_state(config, placement, task_class, data, *, seed: int, total_steps: int, writable: bool = True):
    """The Task and its TrainState (model, built optimizer, updater, counters) in strategy.scope().
    writable=False: a checkpoint that only reads (an evaluator never saves into the run)."""
    task = task_class(config, spec=data.spec)
    task.total_steps = total_steps
    state = create_state(placement.strategy, task, seed=seed, model_dir=config.model_dir,
                         is_chief=placement.is_chief, keep=config.keep_checkpoints, writable=writable)
    return task, state
