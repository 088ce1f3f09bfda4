"""Random ops that differ per replica, yet repeat run to run with --seed.

Keras 3 random layers (Dropout, GaussianNoise, RandomFlip, ...) draw their seeds from a
`keras.random.SeedGenerator` whose state, a [seed, counter] variable, is created in
strategy.scope() and so mirrored: every replica reads the same state and draws the SAME mask
(measured: 2 CPU replicas, Dropout(0.5) of an all-ones input, identical masks on both, call after
call). `per_replica_randomness(model)` folds the global replica id into each seed the model's
generators hand out, in replica context only; the mirrored state itself still advances identically
on every replica, so the replicas stay in sync and a seeded run repeats. Replica 0 (and a run
with one replica, or a call outside strategy.run) gets exactly the seed Keras would give.

For a researcher's own random ops in a step, `replica_seed(global_seed, step, salt)` gives a
seed for `tf.random.stateless_*` (Task.random_seed calls it with the run's seed and step).
"""

from __future__ import annotations

import tensorflow as tf

from engine import compat

_INT32_RANGE = 2**31 - 1  # Keras casts int64 seeds to int32 modulo int32.max - 1; stay below that.


def _global_replica_id():
    """This replica's id across all workers, in replica context with 2+ replicas; else None.

    A Python int when TensorFlow knows it at trace time (Mirrored and MultiWorkerMirrored do),
    else an int32 tensor."""
    if tf.distribute.in_cross_replica_context():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replica_id = context.replica_id_in_sync_group
    static = tf.get_static_value(replica_id)
    return int(static) if static is not None else replica_id


def _to_int32_seed(seed):
    """A [2] seed as int32 the way Keras' TF backend casts it (stateless ops under XLA need int32)."""
    if seed.dtype == tf.int32:
        return seed
    return tf.cast(tf.math.floormod(seed, tf.cast(tf.int32.max - 1, seed.dtype)), tf.int32)


def fold_replica(seed):
    """`seed` ([2] int32/int64) made distinct for this replica, same dtype and shape.

    Replica 0, one replica, or no replica context: `seed` itself, untouched. Other replicas:
    tf.random.fold_in of the replica id (a hash of the seed, so no replica's seed equals another
    replica's seed of a later step, as adding the id to the counter would)."""
    replica_id = _global_replica_id()
    if replica_id is None:
        return seed
    if isinstance(replica_id, int) and replica_id == 0:
        return seed
    seed = tf.convert_to_tensor(seed)
    folded = tf.cast(tf.random.fold_in(_to_int32_seed(seed), tf.cast(replica_id, tf.int32)), seed.dtype)
    if isinstance(replica_id, int):
        return folded
    return tf.where(tf.equal(replica_id, 0), seed, folded)


def _per_replica_next(self, ordered=True):
    """SeedGenerator.next, then folded with the replica id (see fold_replica)."""
    return fold_replica(type(self).next(self, ordered=ordered))


def seed_generators(model) -> list:
    """Every keras.random.SeedGenerator the model and its sublayers own (each once)."""
    found, seen = [], set()
    for layer in compat.flatten_layers(model, include_self=True):
        for generator in compat.layer_seed_generators(layer):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def per_replica_randomness(model) -> int:
    """Makes every random layer of `model` draw different values on each replica.

    Call it once the model's layers exist (the engine does, right after Task.build_model).
    Idempotent. Returns how many seed generators it newly wrapped. Generators created later (a
    layer made lazily in build()) are not covered: call it again after the first step if so.
    The generators' own state, get_config and saving are unchanged.
    """
    wrapped = 0
    for generator in seed_generators(model):
        if compat.wrap_seed_generator_next(generator, _per_replica_next):
            wrapped += 1
    return wrapped


def replica_seed(global_seed: int, step, salt=0, per_replica: bool = True):
    """A [2] int32 seed for tf.random.stateless_* ops: a function of (global_seed, step, salt,
    global replica id), so it differs per replica and per step and repeats run to run.

    Use a different `salt` for each independent draw within one step. Outside replica context (or
    with one replica) the replica id is 0. per_replica=False: the same seed on every replica.
    """
    if global_seed is None or step is None:
        raise ValueError(
            "replica_seed needs the run's seed and step (Task.seed and Task.global_step, "
            "which the engine sets before the first step)"
        )
    base = tf.stack(
        [
            tf.constant(int(global_seed) % _INT32_RANGE, tf.int32),
            tf.cast(tf.math.floormod(tf.cast(salt, tf.int64), _INT32_RANGE), tf.int32),
        ]
    )
    step = tf.cast(tf.math.floormod(tf.cast(step, tf.int64), _INT32_RANGE), tf.int32)
    replica_id = _global_replica_id() if per_replica else None
    replica_id = 0 if replica_id is None else replica_id
    return tf.random.fold_in(tf.random.fold_in(base, step), tf.cast(replica_id, tf.int32))
