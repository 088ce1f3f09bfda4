"""A source's tf.data pipelines, split across replicas and workers, at the GLOBAL batch.

In-memory sources (engine/data/arrays.py) go through `--input_mode`: one pipeline of global
batches split by `strategy.experimental_distribute_dataset`, or per-worker pipelines
(`distribute_datasets_from_function`) that keep each worker's slice of the same global batches.
Streamed sources (engine/data/streams.py) always build one pipeline per worker with
`distribute_datasets_from_function`, sharded by file or by record.
"""

from __future__ import annotations

import tensorflow as tf

from engine.config import INPUT_MODES
from engine.errors import UserError


def example_augmentation(task, seed: int):
    """(features, label, stream position) -> augmented example, or None when the Task has no
    `augment_example`. Its seed [run seed, position] differs per example and per epoch (a position
    is never reused) and repeats with --seed and after a resume."""
    from engine.task import Task

    if type(task).augment_example is Task.augment_example:
        return None

    def augment(features, label, position):
        return task.augment_example(features, label, tf.stack([tf.constant(seed, tf.int64), position]))

    return augment


def distributed_train_data(strategy, source, config, task, seed: int, skip_batches: int):
    """The endless training stream split across replicas."""
    augment = example_augmentation(task, seed)
    if source.streamed:
        return strategy.distribute_datasets_from_function(
            source.train_dataset_fn(config.global_batch, seed, skip_batches, augment))
    if config.input_mode == "per_worker":
        return strategy.distribute_datasets_from_function(
            source.per_worker_train_dataset_fn(config.global_batch, seed, skip_batches, augment))
    if config.input_mode != "distribute_dataset":
        raise UserError(f"unknown --input_mode={config.input_mode!r}; valid: {', '.join(INPUT_MODES)}")
    return strategy.experimental_distribute_dataset(
        source.train_dataset(config.global_batch, seed, skip_batches, augment))


def distributed_eval_data(strategy, source, config):
    """Every test example exactly once, split across replicas (and workers)."""
    if source.streamed:
        return strategy.distribute_datasets_from_function(source.eval_dataset_fn(config.global_batch))
    return strategy.experimental_distribute_dataset(source.eval_dataset(config.global_batch))


def steps_per_epoch(source, global_batch: int) -> int:
    steps = source.num_train // global_batch
    if steps == 0:
        raise UserError(
            f"--global_batch={global_batch} is larger than the {source.num_train} training examples"
        )
    return steps
