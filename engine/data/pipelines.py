"""The tf.data pipelines that feed the replicas, at the GLOBAL batch.

Training:   shuffle (seeded, a new permutation each epoch) -> batch(GLOBAL batch, drop remainder)
            -> repeat -> skip(batches already trained, on resume) -> gather + normalise -> prefetch
Evaluation: batch(GLOBAL batch, partial last batch kept) -> normalise -> prefetch
Both are split across replicas (and workers) by `strategy.experimental_distribute_dataset`.

No tf.data autotuning (`Options.autotune.enabled = False`), here nor on the per-device datasets
TensorFlow builds to distribute them: deleting an iterator of an autotuned dataset could block for
up to a minute. Its autotune thread sleeps between optimisations (periods 10 ms doubling up to
60 s), and the iterator's destructor wakes it and waits for it; TF 2.21's CancellationManager
runs that wake-up callback before it marks itself cancelled, so a thread that wakes at once sees
"not cancelled" and sleeps out the rest of its period (measured: a run lingered 4-20 s after its
summary, the main thread in ~RootDataset::Iterator, holding the GIL). Without autotuning there is
no such thread; AUTOTUNE values then take TensorFlow's static defaults (map parallelism = min(16,
cores), a prefetch buffer that grows while it runs dry): Fashion-MNIST under 1-replica mirrored
trained at 8.9k vs 9.1k examples/s (medians of 4 runs each on a shared 2-core machine: noise).
"""

from __future__ import annotations

import tensorflow as tf

from engine.config import INPUT_MODES
from engine.data.sources import ArrayData
from engine.errors import UserError


def _normalise(images, labels):
    images = tf.cast(images, tf.float32)[..., tf.newaxis] / 255.0
    return images, tf.cast(labels, tf.int32)


def _without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.autotune.enabled = False  # see the module docstring: deleting its iterator could block
    return dataset.with_options(options)


def _with_options(dataset: tf.data.Dataset, deterministic: bool = True) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = deterministic
    return _without_autotune(dataset.with_options(options))


def _device_datasets_without_autotune() -> None:
    """MirroredStrategy and MultiWorkerMirroredStrategy iterate through a MultiDeviceIterator,
    which builds one dataset per device (`multi_device_iterator_ops._create_device_dataset`: a
    generator over the host iterator + prefetch) with default options, so autotuned, and no public
    option reaches them. This wraps that builder once to switch autotuning off there too (the
    datasets have nothing to tune: their prefetch buffer is fixed). If a TensorFlow version no
    longer has the function, nothing is wrapped (tests/test_exit.py then shows the linger)."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if create is None or getattr(create, "without_autotune", False):
        return

    def create_without_autotune(*args, **kwargs):
        return _without_autotune(create(*args, **kwargs))

    create_without_autotune.without_autotune = True
    multi_device_iterator_ops._create_device_dataset = create_without_autotune


def _index_batches(num_examples: int, global_batch: int, seed: int | None, skip_batches: int):
    """Endless GLOBAL batches of example indices: epoch e is a fresh permutation drawn from
    (seed, e) without state, cut into full batches (the remainder is dropped); batches already
    trained are skipped (cheap: nothing is gathered for them)."""
    steps = num_examples // global_batch
    seed = 0 if seed is None else seed

    def epoch(e):
        order = tf.random.experimental.stateless_shuffle(
            tf.range(num_examples, dtype=tf.int32), seed=tf.stack([tf.constant(seed, tf.int64), e]))
        return tf.data.Dataset.from_tensor_slices(tf.reshape(order[: steps * global_batch], [steps, global_batch]))

    dataset = tf.data.Dataset.range(2**62).flat_map(epoch)
    return dataset.skip(skip_batches) if skip_batches else dataset


def _gather_normalised(images, labels):
    """indices -> (float images in [0, 1] with a channel axis, int32 labels), one gather per batch."""
    images, labels = tf.constant(images), tf.constant(labels)
    return lambda indices: _normalise(tf.gather(images, indices), tf.gather(labels, indices))


def train_dataset(images, labels, global_batch: int, seed: int | None, skip_batches: int = 0):
    """The endless training stream of GLOBAL batches; epoch k is the k-th reshuffle.

    The shuffle permutes indices and each batch is one gather: per-example tf.data work would
    cost about as much CPU as the training step of this small CNN."""
    dataset = _index_batches(len(images), global_batch, seed, skip_batches)
    dataset = dataset.map(_gather_normalised(images, labels), num_parallel_calls=tf.data.AUTOTUNE)
    return _with_options(dataset.prefetch(tf.data.AUTOTUNE))


def per_worker_train_dataset_fn(images, labels, global_batch: int, seed: int | None, skip_batches: int = 0):
    """For `strategy.distribute_datasets_from_function`: each worker's pipeline yields its own
    replicas' per-replica batches. It draws the same seeded global batches as `train_dataset`
    and keeps this worker's contiguous slice, so the replicas see exactly what they would see
    with `experimental_distribute_dataset` (and N workers still train like one replica)."""

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(global_batch)
        local_replicas = context.num_replicas_in_sync // context.num_input_pipelines
        start = context.input_pipeline_id * local_replicas * per_replica

        def this_workers_batches(indices):
            mine = indices[start:start + local_replicas * per_replica]
            return tf.data.Dataset.from_tensor_slices(tf.reshape(mine, [local_replicas, per_replica]))

        dataset = _index_batches(len(images), global_batch, seed, skip_batches)
        dataset = dataset.flat_map(this_workers_batches)
        dataset = dataset.map(_gather_normalised(images, labels), num_parallel_calls=tf.data.AUTOTUNE)
        return _without_autotune(dataset.prefetch(tf.data.AUTOTUNE))

    return dataset_fn


def eval_dataset(images, labels, global_batch: int):
    """Every test example once, in order, the last partial batch included."""
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch)
    dataset = dataset.map(_normalise, num_parallel_calls=tf.data.AUTOTUNE)
    return _with_options(dataset.prefetch(tf.data.AUTOTUNE))


def distributed_train_data(strategy, data: ArrayData, config, seed: int, skip_batches: int):
    """The training stream split across replicas, by `--input_mode`."""
    _device_datasets_without_autotune()
    arrays = (data.train_images, data.train_labels, config.global_batch, seed, skip_batches)
    if config.input_mode == "per_worker":
        return strategy.distribute_datasets_from_function(per_worker_train_dataset_fn(*arrays))
    if config.input_mode != "distribute_dataset":
        raise UserError(f"unknown --input_mode={config.input_mode!r}; valid: {', '.join(INPUT_MODES)}")
    return strategy.experimental_distribute_dataset(train_dataset(*arrays))


def distributed_eval_data(strategy, data: ArrayData, global_batch: int):
    """The whole eval set split across replicas (every example once)."""
    _device_datasets_without_autotune()
    return strategy.experimental_distribute_dataset(eval_dataset(data.test_images, data.test_labels, global_batch))


def steps_per_epoch(data: ArrayData, global_batch: int) -> int:
    steps = len(data.train_images) // global_batch
    if steps == 0:
        raise UserError(
            f"--global_batch={global_batch} is larger than the {len(data.train_images)} training examples"
        )
    return steps
