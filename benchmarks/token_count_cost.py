"""What the language model's extra scalar all-reduce (the global real-token count) costs per step.

  python benchmarks/token_count_cost.py [--replicas=2] [--seq_len=128] [--global_batch=32] [--rounds=5]

In one process, on the same MirroredStrategy over --replicas logical CPU devices: the engine's
compiled train loop with LanguageModelTask (divides by the all-reduced GLOBAL count) and with the
same Task dividing by a count it computes without a collective (the replica's own count times the
replica count: the same arithmetic, no all-reduce; equal to the right loss here, since this batch
has no padding), timed in alternating rounds so that load from other processes hits both alike;
and a loop of the bare scalar all-reduce alone. Prints the median milliseconds per step of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from engine.config import Config  # noqa: E402
from engine.controller.state import create_state  # noqa: E402
from engine.data.spec import DataSpec  # noqa: E402
from engine.distribute.strategy import build_strategy  # noqa: E402
from engine.loop import make_train_loop  # noqa: E402
from engine.tasks.language_model import LanguageModelTask  # noqa: E402

STEPS = 20  # steps per timed compiled loop


class NoCollectiveCount(LanguageModelTask):
    def normaliser(self, labels):
        context = tf.distribute.get_replica_context()
        local = tf.reduce_sum(tf.cast(labels >= 0, tf.float32))
        return tf.maximum(local, 1.0) * context.num_replicas_in_sync


def _loop(strategy, task_class, args, model_dir):
    config = Config(
        task="language_model",
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        optimizer="adam",
        seed=1,
        model_dir=model_dir,
    )
    spec = DataSpec(tf.TensorSpec((args.seq_len,), tf.int32), tf.TensorSpec((args.seq_len,), tf.int32), 256)
    task = task_class(config, spec)
    state = create_state(strategy, task, seed=1, model_dir=model_dir, is_chief=True, keep=1)
    loop = make_train_loop(strategy, task, state.global_step)
    rng = np.random.default_rng(0)
    batch = tuple(tf.constant(rng.integers(0, 256, (args.global_batch, args.seq_len)), tf.int32) for _ in range(2))
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch).repeat()))
    return lambda: loop(iterator, tf.constant(STEPS))["steps"].numpy()


def _bare_all_reduce(strategy):
    @tf.function
    def loop(n):
        total = tf.constant(0.0)
        for _ in tf.range(n):
            value = strategy.run(
                lambda: tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))
            )
            total += strategy.experimental_local_results(value)[0]
        return total

    return lambda: loop(tf.constant(STEPS)).numpy()


def _ms_per_step(run) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1000 / STEPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--global_batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    strategy = build_strategy("mirrored", cpu_replicas=args.replicas).strategy
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "with the all-reduce (LanguageModelTask)": _loop(strategy, LanguageModelTask, args, tmp + "/a"),
            "without (own count x replicas)": _loop(strategy, NoCollectiveCount, args, tmp + "/b"),
            "the scalar all-reduce alone": _bare_all_reduce(strategy),
        }
        times = {name: [] for name in runs}
        for run in runs.values():
            run()  # trace
        for _ in range(args.rounds):
            for name, run in runs.items():
                times[name].append(_ms_per_step(run))
    print(
        f"{args.replicas} replicas, global batch {args.global_batch} x seq_len {args.seq_len}, "
        f"median of {args.rounds} rounds of {STEPS} steps:"
    )
    for name, values in times.items():
        print(
            f"  {name:42s} {statistics.median(values):8.3f} ms/step  (rounds: "
            + ", ".join(f"{v:.2f}" for v in values)
            + ")"
        )


if __name__ == "__main__":
    main()
