"""Tasks about the input: a Task's own pipelines, an evaluation that counts which examples it saw,
a per-example augmentation: tests/test_sources.py, tests/test_resident.py,
tests/test_images_source.py, tests/test_tfds_source.py, tests/test_multi_worker.py and
tests/helpers.py load them with --task=tests/tasks_data.py:Name or import them."""

from __future__ import annotations

import tensorflow as tf

from engine.task import Task


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
    tells each example was evaluated exactly once (tests/helpers.py: id_arrays, id_shards write such
    data)."""

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


class FlipTask(Task):
    """Classification with an augmentation: each example negated or not, seeded by its stream position."""

    def augment_example(self, features, label, seed):
        flip = tf.random.stateless_uniform([], seed=seed) < 0.5
        return tf.where(flip, -features, features), label
