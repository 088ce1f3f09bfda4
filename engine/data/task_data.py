"""A Task's own input pipelines (`Task.datasets`), fed to the replicas like any streamed source.

    class MyTask(Task):
        @classmethod
        def datasets(cls, config):
            def train(context, seed, skip_batches):
                batch = context.get_per_replica_batch_size(config.global_batch)
                ds = my_examples("train").shard(context.num_input_pipelines, context.input_pipeline_id)
                ds = ds.shuffle(10_000, seed=seed).repeat().batch(batch, drop_remainder=True)
                return ds.skip(skip_batches * context.num_replicas_in_sync // context.num_input_pipelines)

            def evaluate(context):
                batch = context.get_per_replica_batch_size(config.global_batch)
                return my_examples("test").shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch)

            return TaskDatasets(train=train, evaluate=evaluate, num_train=60_000, num_test=10_000, num_classes=10)

Both functions get a `tf.distribute.InputContext` (one per worker) and return PER-REPLICA batches
of (features, labels); the engine passes them to `strategy.distribute_datasets_from_function`.
`train` is endless and skips what a resumed run already trained (`skip_batches` global steps);
`evaluate` yields every test example exactly once across all input pipelines.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from engine.data.formats import check_example_pair, with_options
from engine.data.spec import DataSpec
from engine.errors import UserError


@dataclasses.dataclass(frozen=True)
class TaskDatasets:
    train: Callable  # (InputContext, seed, skip_batches) -> endless per-replica batches
    evaluate: Callable  # (InputContext) -> per-replica batches of every test example once
    num_train: int  # examples per epoch (for steps per epoch)
    num_test: int
    num_classes: Optional[int] = None
    class_names: Optional[tuple] = None


def _engine_options(dataset):
    return with_options(dataset, policy=tf.data.experimental.AutoShardPolicy.OFF)


class TaskSource:
    """Adapts a TaskDatasets to the engine's source interface."""

    streamed = True
    engine_augments = False  # the Task's own pipelines apply its augmentation themselves

    def __init__(self, name: str, datasets: TaskDatasets):
        if not isinstance(datasets, TaskDatasets):
            raise UserError(f"{name}.datasets() returned {type(datasets).__name__}, expected a TaskDatasets")
        self.name, self.where, self.datasets = name, f"{name}.datasets()", datasets
        self.num_train, self.num_test = datasets.num_train, datasets.num_test
        element = self._eval().element_spec
        check_example_pair(f"{self.where}'s evaluate", element)
        unbatched = tuple(tf.TensorSpec(spec.shape[1:], spec.dtype) for spec in element)
        self.spec = DataSpec.of(unbatched, datasets.num_classes, datasets.class_names)

    def _eval(self):
        return self.datasets.evaluate(tf.distribute.InputContext(1, 0, 1))

    def sharding(self, num_pipelines: int) -> str:
        return f"the Task's own pipelines, one per worker ({num_pipelines})"

    def train_dataset_fn(self, global_batch, seed, skip_batches=0, augment=None):
        # The Task augments itself; the engine's options (no autotuning: a prompt exit) are added.
        return lambda context: _engine_options(self.datasets.train(context, seed, skip_batches))

    def eval_dataset_fn(self, global_batch):
        return lambda context: _engine_options(self.datasets.evaluate(context))

    def preview(self, count: int):
        x, y = next(iter(self._eval().unbatch().batch(count)))
        return x.numpy(), y.numpy()

    def test_batches(self, batch_size: int):
        for x, y in self._eval():
            yield x.numpy(), y.numpy()
