"""Startup agreement: every worker checks, with one collective, that all workers run the same
configuration. A flag that differs is a one-line error on every worker, not a silent wrong run.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import tensorflow as tf

from engine import __version__
from engine.errors import UserError

# Config fields every worker must share (paths such as data_dir and model_dir may differ per host).
AGREED_FLAGS = (
    "global_batch",
    "dataset",
    "model",
    "task",
    "optimizer",
    "learning_rate",
    "seed",
    "epochs",
    "train_steps",
    "steps_per_loop",
    "eval_every",
    "checkpoint_every",
    "input_mode",
    "synthetic_train_examples",
    "synthetic_test_examples",
    "deterministic",
    "jit_compile",
    "run_eagerly",
    "lr_schedule",
    "warmup_steps",
    "weight_decay",
    "clip_norm",
    "precision",
    "grad_accum_steps",
    "image_size",
    "validation_split",
    "synthetic_shape",
    "num_classes",
    "shuffle_buffer",
    "cache",
    "seq_len",
)


def _hash(value) -> int:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:7], "big")  # 56 bits: exact in int64


def fingerprint(config, cluster) -> dict:
    """{name: hash} of everything that must match across workers."""
    values = {name: _hash(getattr(config, name)) for name in AGREED_FLAGS}
    values["cluster (TF_CONFIG)"] = _hash(cluster.jobs)
    values["engine version"] = _hash(__version__)
    return values


def agree(strategy, config, cluster, seed: int) -> int:
    """Exchanges fingerprints (one all-gather) and raises UserError naming every flag that
    differs between workers. Returns the chief's seed, which every worker then uses (a run
    without --seed draws one per process)."""
    prints = fingerprint(config, cluster)
    names = sorted(prints)
    local = tf.constant([prints[n] for n in names] + [seed], dtype=tf.int64)
    per_replica = strategy.experimental_distribute_values_from_function(lambda _: local)
    rows = strategy.gather(per_replica, axis=0).numpy().reshape(strategy.num_replicas_in_sync, -1)
    replicas_per_worker = strategy.num_replicas_in_sync // cluster.num_workers
    by_worker = rows[::replicas_per_worker]  # one row per worker, in cluster order (chief first)
    differing = [name for j, name in enumerate(names) if len(np.unique(by_worker[:, j])) > 1]
    if differing:
        workers = [f"{t}:{i}" for t, i, _ in cluster.workers]
        details = []
        for name in differing:
            column = by_worker[:, names.index(name)]
            odd = [workers[w] for w in range(len(workers)) if column[w] != column[0]]
            mine = getattr(config, name, None) if name in AGREED_FLAGS else None
            shown = f" (here --{name}={mine})" if name in AGREED_FLAGS else ""
            details.append(f"--{name}" if name in AGREED_FLAGS else name)
            details[-1] += f" differs on {', '.join(odd)} from {workers[0]}{shown}"
        raise UserError("workers disagree: " + "; ".join(details) + ". Start every worker with the same flags")
    return int(by_worker[0, -1])
