"""Where an engine step's time goes: each piece the engine adds to the bare step, timed in one
process, in paired rounds.

    python -m benchmarks.step_costs                        # mlp, 6 rounds
    python -m benchmarks.step_costs --model=cnn --rounds=4

`benchmarks.models` says how far the engine is from its ceiling; this says why. Each round times
every measurement once, each built afresh right before it is timed (as benchmarks.models does), in
alternating order; a measurement's ratio to the bare step is taken within its round, then the
median over the rounds is printed with its spread:
  bare                    the bare compiled step (benchmarks.models.bare_step) on one constant batch
  bare + gradient norm    the same step with the gradients' global norm added to its result: what
                          the engine's finite check reads each step
  bare, batches in turn   the bare step on 64 batches held in memory, each step the next in turn:
                          a batch its cache did not just hold, as with any real input, with no
                          gather, copy or input pipeline
  engine step, no loop    the engine's replica step alone (the Task's train_step, its metrics, the
                          update with the gradient norm and finite check: engine/loop.py's
                          _TrainStep under strategy.run) on the constant batch, in a plain
                          compiled loop: what the engine's loop adds is the next line's difference
  engine loop             the engine's compiled training loop (engine/loop.py) on the same constant
                          batch, --summaries=full (metrics, finite check, grad_norm, counters)
  engine loop, basic      the same at --summaries=basic (no grad_norm in the loop's result)
  engine loop, resident   the engine's loop fed by --input_mode=resident: the batches gathered from
                          the arrays in memory (with one replica, the next one beside each step)
  resident input alone    the same batches with nothing trained: next() and the gather
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from benchmarks import measure, models  # noqa: E402
from engine.controller import job  # noqa: E402
from engine.data.resident import ResidentTrainData  # noqa: E402
from engine.loop import LoopOptions, _TrainStep  # noqa: E402

SECONDS_PER_TIMING = 2.0  # each timing: one compiled loop of about this long


def timers(name: str, workdir: str) -> tuple:
    """({measurement: a function building that measurement's fresh timer}, batch size)."""
    config = models.config_for(name, workdir)
    task_class, data, _ = job.load_data(config)
    batch = config.global_batch
    # The bare step trains on the first of models.BATCHES_IN_TURN batches (the constant batch) or on
    # each in turn: a batch its cache did not just hold, as with real input, but nothing gathered.
    (features, labels), batch_in_turn = models.batches_in_turn(data, batch)

    def bare_body(with_norm: bool = False, next_batch=lambda: (features, labels)):
        """One bare step on a fresh model and optimizer, for measure's compiled loops."""
        task, model, optimizer = models.fresh_task(config, task_class, data)
        optimizer.build(model.trainable_variables)
        return lambda: models.bare_step(task, model, optimizer, *next_batch(), with_norm=with_norm)

    def engine_step_body():
        """The engine's replica step alone on the constant batch (its outputs all used, so none is pruned)."""
        strategy = tf.distribute.get_strategy()
        task, _ = models.engine_task(config, task_class, data)
        step = _TrainStep(task, tuple(task.train_metrics), LoopOptions(update_summaries=config.summaries == "full"))

        def body():
            stacked, bad, applied, _ = strategy.run(step, args=((features, labels),))
            return tf.reduce_sum(stacked) + tf.cast(bad, tf.float32) + tf.cast(applied, tf.float32)

        return body

    def resident_iterator():
        return iter(ResidentTrainData(tf.distribute.get_strategy(), data, batch, seed=1))

    def input_body():
        """The next resident batch, made in full, with nothing trained."""
        iterator = resident_iterator()

        def body():
            features, _ = iterator.replica_batch(next(iterator))
            return tf.cast(tf.reshape(features, [-1])[0], tf.float32)

        return body

    rough = measure.seconds_per_call(bare_body(), calls=50, timings=3)
    steps = max(20, round(SECONDS_PER_TIMING / rough))
    basic = config.replace(summaries="basic")
    return {
        "bare": lambda: measure.call_timer(bare_body(), steps),
        "bare + gradient norm": lambda: measure.call_timer(bare_body(with_norm=True), steps),
        "bare, batches in turn": lambda: measure.call_timer(bare_body(next_batch=batch_in_turn), steps),
        "engine step, no loop": lambda: measure.call_timer(engine_step_body(), steps),
        "engine loop": lambda: models.engine_loop_timer(config, task_class, data, (features, labels), steps),
        "engine loop, basic": lambda: models.engine_loop_timer(basic, task_class, data, (features, labels), steps),
        "engine loop, resident": lambda: models.engine_loop_timer(
            config, task_class, data, None, steps, iterator=resident_iterator()
        ),
        "resident input alone": lambda: measure.call_timer(input_body(), steps),
    }, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(models.WORKLOADS))
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds (each times every measurement once)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: give 1 or more")
    print(
        f"device: {measure.device_description()}; TensorFlow {tf.__version__}; {args.model}, {args.rounds} rounds",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_step_costs_") as workdir:
        models.write_text(os.path.join(workdir, models.TEXT_FILE))
        build, batch = timers(args.model, workdir)
        names = tuple(build)
        rounds = []
        for index in range(args.rounds):
            rounds.append({key: build[key]()() for key in measure.alternated(names, index)})
    print(f"\n{'measurement':24s} {'us / step':>10s} {'speed / bare, paired (lowest-highest)':>40s}")
    bare = [r["bare"] for r in rounds]
    for key in names:
        seconds = [r[key] for r in rounds]
        line = f"{key:24s} {statistics.median(seconds) * 1e6:10.1f}"
        if key != "resident input alone":  # the others each run the step: their speed against its
            ratio = measure.spread([b / s for b, s in zip(bare, seconds)])
            line += f" {ratio['median']:>24.3f} ({ratio['low']:.3f}-{ratio['high']:.3f})"
        print(line)
    print(f"(global batch {batch}; speed / bare: the bare step's time over the measurement's, in each round)")


if __name__ == "__main__":
    main()
