"""In-memory sources (built-in data sets, `npz:PATH`, synthetic) and their tf.data pipelines.

Training:   shuffle (seeded, a new permutation each epoch) -> batch(GLOBAL batch, drop remainder)
            -> repeat -> skip(batches already trained, on resume) -> gather + normalise -> prefetch
Evaluation: batch(GLOBAL batch, partial last batch kept) -> normalise -> prefetch

The shuffle permutes indices and each batch is one gather: per-example tf.data work would cost
about as much CPU as the training step of a small CNN. The arrays become graph constants, so an
in-memory source is limited to MAX_IN_MEMORY_BYTES; larger data belongs in TFRecord files
(`python -m engine.data.tfrecord`), which are streamed.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from engine.data.formats import augment_each, normalise_features, normalise_labels, with_options
from engine.data.spec import DataSpec
from engine.errors import UserError

MAX_IN_MEMORY_BYTES = 1 << 30  # the GraphDef limit is 2 GB; train + test arrays stay well under it


def _normalise(x, y, on_cpu: bool = False):
    return normalise_features(x, on_cpu=on_cpu), normalise_labels(y)


class ArraySource:
    """A whole data set in memory: train and test arrays of any shape and dtype."""

    streamed = False

    def __init__(
        self, name, where, x_train, y_train, x_test, y_test, num_classes=None, class_names=None, pad_label=None
    ):
        """`pad_label`: a label value that marks a padded position, not a class (e.g. -1 in the
        padded tail of a text window); exempt from the range check."""
        self.name, self.where = name, where
        self.x_train, self.y_train, self.x_test, self.y_test = x_train, y_train, x_test, y_test
        _validate(where, x_train, y_train, x_test, y_test)
        integer_labels = np.issubdtype(y_train.dtype, np.integer)
        if num_classes is None and integer_labels:
            num_classes = int(max(y_train.max(), y_test.max())) + 1
        if integer_labels:
            _check_label_range(where, y_train, y_test, num_classes, pad_label)
        features, labels = _normalise(
            tf.zeros((1, *x_train.shape[1:]), x_train.dtype), tf.zeros((1, *y_train.shape[1:]), y_train.dtype)
        )
        self.spec = DataSpec(
            tf.TensorSpec(features.shape[1:], features.dtype),
            tf.TensorSpec(labels.shape[1:], labels.dtype),
            num_classes if integer_labels else None,
            class_names,
            raw_features=tf.TensorSpec(x_train.shape[1:], tf.as_dtype(x_train.dtype)),
        )

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    @property
    def num_test(self) -> int:
        return len(self.x_test)

    def sharding(self, num_pipelines: int) -> str:
        return (
            "in memory: each global batch split across replicas"
            if num_pipelines == 1
            else ("in memory: every worker draws the same global batches and keeps its replicas' slice")
        )

    def preview(self, count: int):
        """The first `count` training examples, normalised, as NumPy (x, y)."""
        x, y = _normalise(tf.constant(self.x_train[:count]), tf.constant(self.y_train[:count]))
        return x.numpy(), y.numpy()

    def test_batches(self, batch_size: int):
        """Every test example once, normalised NumPy (x, y) batches, on this host (no collective)."""
        for start in range(0, self.num_test, batch_size):
            x, y = _normalise(
                tf.constant(self.x_test[start : start + batch_size]),
                tf.constant(self.y_test[start : start + batch_size]),
            )
            yield x.numpy(), y.numpy()

    def train_dataset(self, global_batch, seed, skip_batches=0, augment=None):
        return train_dataset(self.x_train, self.y_train, global_batch, seed, skip_batches, augment)

    def per_worker_train_dataset_fn(self, global_batch, seed, skip_batches=0, augment=None):
        return per_worker_train_dataset_fn(self.x_train, self.y_train, global_batch, seed, skip_batches, augment)

    def eval_dataset(self, global_batch):
        return eval_dataset(self.x_test, self.y_test, global_batch)


def _validate(where, x_train, y_train, x_test, y_test) -> None:
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.ndim < 2:
            raise UserError(
                f"{where}: {split} features have shape {x.shape}, expected (N, ...) with one row per example"
            )
        if x.shape[1:] != x_train.shape[1:]:
            raise UserError(f"{where}: test features are {x.shape[1:]}, train features {x_train.shape[1:]}")
        if len(y) != len(x) or y.shape[1:] != y_train.shape[1:]:
            raise UserError(
                f"{where}: {split} labels have shape {y.shape}, expected ({len(x)},"
                f"{''.join(f' {d},' for d in y_train.shape[1:])[:-1] if y_train.ndim > 1 else ''})"
            )
        if len(x) == 0:
            raise UserError(f"{where}: the {split} split is empty")
        for name, array in (("features", x), ("labels", y)):
            if not (
                np.issubdtype(array.dtype, np.integer)
                or np.issubdtype(array.dtype, np.floating)
                or array.dtype == np.bool_
            ):
                raise UserError(f"{where}: {split} {name} have dtype {array.dtype}; expected numbers")
    size = sum(a.nbytes for a in (x_train, y_train, x_test, y_test))
    if size > MAX_IN_MEMORY_BYTES:
        raise UserError(
            f"{where}: {size / 2**30:.1f} GiB is too large to train from memory (limit "
            f"{MAX_IN_MEMORY_BYTES / 2**30:.0f} GiB); write it to TFRecord shards with "
            "`python -m engine.data.tfrecord` and use --dataset=tfrecord:GLOB (streamed)"
        )


def _check_label_range(where, y_train, y_test, num_classes, pad_label=None) -> None:
    for split, y in (("train", y_train), ("test", y_test)):
        if pad_label is not None:
            y = y[y != pad_label]
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= num_classes:
            raise UserError(
                f"{where}: {split} labels range over [{low}, {high}], expected "
                f"[0, {num_classes - 1}] (--num_classes={num_classes})"
            )


def epoch_order(num_examples: int, seed: int | None, epoch):
    """The example indices of epoch `epoch` (an int64 tensor): a permutation drawn from (seed, epoch)
    without state, so any epoch's order can be computed again (resume, rollback, input_mode=resident)."""
    return tf.random.experimental.stateless_shuffle(
        tf.range(num_examples, dtype=tf.int32),
        seed=tf.stack([tf.constant(0 if seed is None else seed, tf.int64), tf.cast(epoch, tf.int64)]),
    )


def _index_batches(num_examples: int, global_batch: int, seed: int | None, skip_batches: int):
    """Endless (batch number, GLOBAL batch of example indices): epoch e is a fresh permutation
    drawn from (seed, e) without state, cut into full batches (the remainder is dropped); batches
    already trained are skipped (cheap: nothing is gathered for them)."""
    steps = num_examples // global_batch

    def epoch(e):
        order = epoch_order(num_examples, seed, e)
        return tf.data.Dataset.from_tensor_slices(tf.reshape(order[: steps * global_batch], [steps, global_batch]))

    dataset = tf.data.Dataset.range(2**62).flat_map(epoch).enumerate()
    return dataset.skip(skip_batches) if skip_batches else dataset


def gather_normalised(features, labels, global_batch, augment, dtypes=None, on_cpu: bool = True):
    """(batch number, indices[, rows]) -> normalised (features, labels), one gather per batch, or
    what `augment` returns (per example, with its stream position as seed) when the Task has one; `rows`: the
    examples' places in their global batch (default: 0, 1, ...). `features` and `labels` are
    arrays (made constants) or variables (read where the gather runs: input_mode=resident);
    `dtypes`: the (features, labels) dtypes to cast the gathered values back to, when stored wider;
    `on_cpu`: the gather runs on a CPU (tf.data's maps do; see normalise_features)."""
    if not isinstance(features, tf.Variable):
        features, labels = tf.constant(features), tf.constant(labels)

    def gather(batch_number, indices, rows=None):
        x, y = tf.gather(features, indices), tf.gather(labels, indices)
        if dtypes is not None:
            x, y = tf.cast(x, dtypes[0]), tf.cast(y, dtypes[1])
        x, y = _normalise(x, y, on_cpu)
        if augment is None:
            return x, y
        rows = tf.range(tf.shape(indices)[0], dtype=tf.int64) if rows is None else rows
        return augment_each(augment, x, y, batch_number * global_batch + rows)  # any structure it returns

    return gather


def train_dataset(features, labels, global_batch: int, seed: int | None, skip_batches: int = 0, augment=None):
    """The endless training stream of GLOBAL batches; epoch k is the k-th reshuffle."""
    dataset = _index_batches(len(features), global_batch, seed, skip_batches)
    dataset = dataset.map(
        gather_normalised(features, labels, global_batch, augment), num_parallel_calls=tf.data.AUTOTUNE
    )
    return with_options(dataset.prefetch(tf.data.AUTOTUNE))


def per_worker_train_dataset_fn(
    features, labels, global_batch: int, seed: int | None, skip_batches: int = 0, augment=None
):
    """For `strategy.distribute_datasets_from_function`: each worker's pipeline yields its own
    replicas' per-replica batches. It draws the same seeded global batches as `train_dataset`
    and keeps this worker's contiguous slice, so the replicas see exactly what they would see
    with `experimental_distribute_dataset` (and N workers still train like one replica)."""

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(global_batch)
        local_replicas = context.num_replicas_in_sync // context.num_input_pipelines
        start = context.input_pipeline_id * local_replicas * per_replica
        gather = gather_normalised(features, labels, global_batch, augment)

        def this_workers_batches(batch_number, indices):
            mine = tf.reshape(indices[start : start + local_replicas * per_replica], [local_replicas, per_replica])
            rows = tf.reshape(
                tf.range(start, start + local_replicas * per_replica, dtype=tf.int64), [local_replicas, per_replica]
            )
            return tf.data.Dataset.from_tensor_slices((tf.fill([local_replicas], batch_number), mine, rows))

        dataset = _index_batches(len(features), global_batch, seed, skip_batches)
        dataset = dataset.flat_map(this_workers_batches)
        dataset = dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE)
        return with_options(dataset.prefetch(tf.data.AUTOTUNE), policy=tf.data.experimental.AutoShardPolicy.OFF)

    return dataset_fn


def eval_dataset(features, labels, global_batch: int):
    """Every test example once, in order, the last partial batch included."""
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(global_batch)
    dataset = dataset.map(_normalise, num_parallel_calls=tf.data.AUTOTUNE)
    return with_options(dataset.prefetch(tf.data.AUTOTUNE))
