"""Streamed sources (TFRecord shards, image folders): read lazily from files, never whole.

A stream source is a list of UNITS (a TFRecord file; an image file with its label) and two
functions: `read(unit) -> tf.data.Dataset` of raw records (bytes, no decoding) and
`decode(record) -> (features, label)`. A unit or a record may be a tuple (an array per part, e.g.
(paths, labels)): `read` and `decode` then take its parts as arguments, read(path, label). Its
pipelines:

Training, per input pipeline (one per worker):
    units of this pipeline (sharded, see below) -> epoch e: units in a (seed, e) order ->
    interleave(read, READ_BLOCK records of each unit in turn, deterministic)
    -> shuffle(--shuffle_buffer, seed (seed, e)) -> endless
    -> skip(records already trained, on resume: raw records, nothing decoded)
    -> decode (+ the Task's augmentation, seeded by the record's stream position)
    -> batch(per-replica batch) -> prefetch
A source that can decode a whole batch at once (`decode_batch`, e.g. TFRecords of the default
schema: one parse_example per batch) batches the raw records first and decodes each batch in one
call: the same examples in the same order, without tf.data's per-record function call.
--cache keeps each pipeline's raw records in memory after the first pass (the units are then
read in one fixed order and the shuffle buffer alone shuffles).
Evaluation: the units in order -> read -> decode -> batch(per-replica, partial kept) -> prefetch.

Both go through `strategy.distribute_datasets_from_function`. With one pipeline its replicas
take consecutive per-replica batches, i.e. exactly the global batches of one replica's stream, so
N replicas train like one. With several workers the units are split by FILE (pipeline i reads
units i, i+n, ...) when there are at least as many units as pipelines, else by DATA (every
pipeline reads all units and keeps every n-th record): each example is read by one worker.

Resume skips the records already trained without decoding them: the cost is reading and
shuffling their bytes again (docs/data.md has the measured seconds).
"""

from __future__ import annotations

import time

import tensorflow as tf

from engine.data.formats import augment_each, with_options
from engine.errors import UserError

DEFAULT_SHUFFLE_BUFFER = 10_000
CYCLE_LENGTH = 8  # files read at once by the interleave
# Records a training reader hands the parallel interleave at a time: each element crossing its
# threads costs a hand-over, so blocks of records cut the training pipeline's CPU time
# (docs/performance.md, "Input from files"). Evaluation reads one record of each unit in turn (the
# original order of round-robin shards).
READ_BLOCK = 32


def epoch_seed(seed: int, epoch):
    """A per-epoch int64 seed for tf.data's shuffle, from the run's seed and the epoch tensor."""
    return tf.constant(seed, tf.int64) * 1_000_003 + epoch


class StreamSource:
    """Train/test units, their reader and decoder, and what is known of the data."""

    streamed = True

    def __init__(
        self,
        *,
        name,
        where,
        train_units,
        test_units,
        read,
        decode,
        spec,
        num_train,
        num_test,
        shuffle_buffer=DEFAULT_SHUFFLE_BUFFER,
        cache=False,
        decode_batch=None,
        check=None,
    ):
        """`decode_batch(records) -> (features, labels)`: optional, `decode` over a batch of records
        (a 1-D tensor of them) in one call, giving exactly what per-record decoding gives.
        `check(*unit) -> 'FILE: where: cause' or None`: optional, reads one unit again off the
        training path to name a bad record after the pipeline failed (engine/data/bad_records.py)."""
        self.name, self.where, self.spec = name, where, spec
        self.train_units, self.test_units = train_units, test_units
        self.read, self.decode, self.decode_batch = read, decode, decode_batch
        self.num_train, self.num_test = num_train, num_test
        self.shuffle_buffer, self.cache = shuffle_buffer, cache
        self.check, self.loaded_at = check, time.time()  # files modified after loaded_at are checked first

    @staticmethod
    def _policy(units, pipelines: int) -> str:
        """ "one" (a single pipeline), "FILE" (enough units for each pipeline its own) or "DATA"."""
        if pipelines == 1:
            return "one"
        return "FILE" if len(tf.nest.flatten(units)[0]) >= pipelines else "DATA"

    def _units_for(self, units, pipeline: int, pipelines: int):
        """(this pipeline's units, whether records must still be split by DATA)."""
        policy = self._policy(units, pipelines)
        if policy == "FILE":
            return tf.nest.map_structure(lambda u: u[pipeline::pipelines], units), False
        return units, policy == "DATA"

    def sharding(self, num_pipelines: int) -> str:
        count = len(tf.nest.flatten(self.train_units)[0])
        policy = self._policy(self.train_units, num_pipelines)
        if policy == "one":
            return f"one input pipeline over {count} files"
        if policy == "FILE":
            return f"by FILE: {count} files over {num_pipelines} input pipelines"
        return f"by DATA: {count} files < {num_pipelines} input pipelines, each keeps every {num_pipelines}-th record"

    def _records(self, units, by_data, pipeline, pipelines, block: int = 1):
        """Raw records of `units`, `block` records of each unit in turn (1: one of each in turn, which
        gives shards written round-robin back in their original order)."""
        dataset = tf.data.Dataset.from_tensor_slices(units)
        read = self.read if block == 1 else lambda *unit: self.read(*unit).batch(block)
        dataset = dataset.interleave(
            read, cycle_length=CYCLE_LENGTH, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )
        dataset = dataset if block == 1 else dataset.unbatch()
        return dataset.shard(pipelines, pipeline) if by_data else dataset

    def train_dataset_fn(self, global_batch: int, seed: int, skip_batches: int = 0, augment=None):
        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            per_replica = context.get_per_replica_batch_size(global_batch)
            local_batch = per_replica * (context.num_replicas_in_sync // context.num_input_pipelines)
            pipeline, pipelines = context.input_pipeline_id, context.num_input_pipelines
            units, by_data = self._units_for(self.train_units, pipeline, pipelines)
            count = len(tf.nest.flatten(units)[0])

            cached = self._records(units, by_data, pipeline, pipelines, READ_BLOCK).cache() if self.cache else None

            def epoch(e):
                if cached is not None:  # --cache: units in a fixed order, read once; the buffer shuffles
                    records = cached
                else:
                    order = tf.random.experimental.stateless_shuffle(
                        tf.range(count, dtype=tf.int32), seed=tf.stack([tf.constant(seed, tf.int64), e])
                    )
                    shuffled = tf.nest.map_structure(lambda u: tf.gather(u, order), units)
                    records = self._records(shuffled, by_data, pipeline, pipelines, READ_BLOCK)
                return records.shuffle(self.shuffle_buffer, seed=epoch_seed(seed, e))

            records = tf.data.Dataset.range(2**62).flat_map(epoch)
            start = skip_batches * local_batch  # records already trained: skipped raw, nothing decoded
            records = records.skip(start) if start else records
            dataset = self._decoded_batches(records, start, per_replica, augment, pipeline)
            return with_options(dataset.prefetch(tf.data.AUTOTUNE), policy=tf.data.experimental.AutoShardPolicy.OFF)

        return dataset_fn

    def _decoded_batches(self, records, start: int, per_replica: int, augment, pipeline: int):
        """Raw records from stream position `start` on -> decoded, augmented per-replica batches.
        Positions (the augmentation's seeds) are counted only where a Task augments."""
        if augment is None:
            return self._batched(records, per_replica, drop_remainder=True)
        records = records.enumerate(start)
        offset = tf.constant(pipeline, tf.int64) * (1 << 40)  # positions distinct across pipelines

        if self.decode_batch is not None:

            def decode_batch(positions, records):
                return augment_each(augment, *self.decode_batch(records), positions + offset)

            return records.batch(per_replica, drop_remainder=True).map(
                decode_batch, num_parallel_calls=tf.data.AUTOTUNE
            )

        def decode(position, record):  # tuple records as separate arguments, as Dataset.map passes them
            x, y = self.decode(*record) if isinstance(record, tuple) else self.decode(record)
            return augment(x, y, position + offset)

        return records.map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(per_replica, drop_remainder=True)

    def eval_dataset_fn(self, global_batch: int):
        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            per_replica = context.get_per_replica_batch_size(global_batch)
            pipeline, pipelines = context.input_pipeline_id, context.num_input_pipelines
            units, by_data = self._units_for(self.test_units, pipeline, pipelines)
            dataset = self._records(units, by_data, pipeline, pipelines)
            if self.cache:
                dataset = dataset.cache()  # raw records of the test split, kept after the first eval
            return with_options(
                self._batched(dataset, per_replica).prefetch(tf.data.AUTOTUNE),
                policy=tf.data.experimental.AutoShardPolicy.OFF,
            )

        return dataset_fn

    def _batched(self, records, batch_size: int, drop_remainder: bool = False):
        """Raw records in order -> decoded batches (the last one partial unless drop_remainder)."""
        if self.decode_batch is not None:
            return records.batch(batch_size, drop_remainder=drop_remainder).map(
                self.decode_batch, num_parallel_calls=tf.data.AUTOTUNE
            )
        return records.map(self.decode, num_parallel_calls=tf.data.AUTOTUNE).batch(
            batch_size, drop_remainder=drop_remainder
        )

    def decoded_batches(self, split: str, batch_size: int):
        """Every example of `split` ("train" or "test") once, in file order, as decoded NumPy (x, y)
        batches on this host (no collective)."""
        units = self.train_units if split == "train" else self.test_units
        for x, y in self._batched(self._records(units, False, 0, 1), batch_size).prefetch(2):
            yield x.numpy(), y.numpy()

    def preview(self, count: int):
        return next(self.decoded_batches("train", count))

    def test_batches(self, batch_size: int):
        return self.decoded_batches("test", batch_size)


def check_not_empty(where: str, split: str, count: int) -> int:
    if count == 0:
        raise UserError(f"{where}: the {split} split holds no records")
    return count
