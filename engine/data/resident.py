"""`--input_mode=resident`: an in-memory source's training arrays held in every replica's device
memory, each step's batch gathered by index inside the compiled loop (no tf.data in training).

The loop's `next(iterator)` reads the next global batch's example indices from a batch counter and
the epoch's permutation (the same `epoch_order` as the tf.data path, engine/data/arrays.py, kept
for the epoch in a variable); each replica then gathers its contiguous slice of that global batch
from its own copy of the arrays (a mirrored variable), normalises it and applies the Task's
augmentation seeded by the example's stream position. So every replica gets exactly the examples
`experimental_distribute_dataset` would give it, N replicas and N workers train like one, and resume
and rollback start the counter at the data position. The arrays are not checkpointed.

The iterator's protocol with engine/loop.py: `next(iterator)` (cross-replica context) returns a
small reference to the batch, and `iterator.replica_batch(reference)` (replica context, inside
`strategy.run`) returns this replica's (features, labels). With one replica the loop gathers one
step ahead and calls `iterator.give_back()` after its last step, so the position counts exactly
the batches trained on.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from engine.data.arrays import epoch_order, gather_normalised

# Dtypes a collective broadcast refuses (MultiWorkerMirroredStrategy's variable initialisation).
_NOT_BROADCAST = (tf.uint8, tf.int8, tf.uint16, tf.int16)


class ResidentTrainData:
    """The training arrays on every replica's device; `iter()` gives the batch counter's iterator."""

    def __init__(self, strategy, source, global_batch: int, seed: int | None, skip_batches: int = 0, augment=None):
        self.num_examples, self.global_batch, self.seed = source.num_train, global_batch, seed
        self.steps_per_epoch = source.num_train // global_batch
        self.per_replica = global_batch // strategy.num_replicas_in_sync
        self.skip_batches = skip_batches
        arrays = [source.x_train, source.y_train]
        dtypes = [tf.as_dtype(a.dtype) for a in arrays]
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            # Its variables start from worker 0's value by a collective broadcast, which takes no
            # 8- or 16-bit integers: those are held as int32 and cast back after each gather.
            arrays = [a.astype(np.int32) if t in _NOT_BROADCAST else a for a, t in zip(arrays, dtypes)]
        with strategy.scope():  # mirrored: each replica reads its own device's copy
            features = tf.Variable(arrays[0], trainable=False, name="resident_features")
            labels = tf.Variable(arrays[1], trainable=False, name="resident_labels")
        self.gather = gather_normalised(
            features, labels, global_batch, augment, dtypes, on_cpu="CPU" in features.device.upper()
        )

    def __iter__(self):
        return ResidentIterator(self, self.skip_batches)


class ResidentIterator:
    def __init__(self, data: ResidentTrainData, position: int):
        self.data = data
        self.position = tf.Variable(position, dtype=tf.int64, trainable=False, name="resident_position")
        self.order = tf.Variable(tf.zeros([data.num_examples], tf.int32), trainable=False, name="resident_order")
        self.order_epoch = tf.Variable(-1, dtype=tf.int64, trainable=False, name="resident_order_epoch")

    def __next__(self):
        """(batch number, the global batch's example indices); the epoch's order is drawn once per epoch."""
        data = self.data
        batch = self.position.assign_add(1) - 1
        epoch = batch // data.steps_per_epoch

        def draw():
            self.order.assign(epoch_order(data.num_examples, data.seed, epoch))
            self.order_epoch.assign(epoch)
            return tf.constant(True)

        drawn = tf.cond(tf.equal(epoch, self.order_epoch), lambda: tf.constant(False), draw)
        with tf.control_dependencies([drawn]):
            start = (batch % data.steps_per_epoch) * data.global_batch
            indices = tf.slice(self.order.read_value(), [tf.cast(start, tf.int32)], [data.global_batch])
        return batch, indices

    def give_back(self) -> None:
        """The last batch taken was not trained on (engine/loop.py gathers one step ahead): the
        next `next()` hands it out again."""
        self.position.assign_sub(1)

    def replica_batch(self, reference):
        """This replica's (features, labels): its contiguous slice of the global batch."""
        batch, indices = reference
        if self.data.per_replica == self.data.global_batch:  # one replica: the whole global batch
            return self.data.gather(batch, indices)
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32)
        rows = replica * self.data.per_replica + tf.range(self.data.per_replica)
        return self.data.gather(batch, tf.gather(indices, rows), tf.cast(rows, tf.int64))
