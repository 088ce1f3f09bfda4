"""Every built-in model against its own ceiling and against Keras `model.fit`, and what that
predicts beyond one machine.

    python -m benchmarks.models                      # all five (run times and results: docs/performance.md)
    python -m benchmarks.models --models=mlp,cnn     # some of them
    python -m benchmarks.models --quick              # fewer steps and repeats (a smoke run)
    python -m benchmarks.models --rounds=5           # more rounds: tighter medians, longer run

The same command on a GPU machine measures on its first GPU (TensorFlow's default device) and
prints the GPU's name and its matmul peak; nothing else changes.

Per model, in a process of its own (so one model's graphs and memory do not weigh on the next),
on in-memory data, one replica, float32, global batch as in WORKLOADS:
  * the bare compiled step: model, the Task's per-example loss, gradient, optimizer update, on one
    constant batch, many steps per tf.function call: no input pipeline, strategy or metrics. The
    engine's ceiling.
  * the same step on 64 batches held in memory, the next each step (nothing gathered or piped, but
    not the batch its cache just held): the ceiling of training on data. On a sub-millisecond step
    the constant batch's cache makes the bare step faster than any training on data (mlp), so
    engine / bare in turn is printed beside engine / bare.
  * the same step fed by the engine's input pipeline: what the input costs.
  * the engine: `train()` with the run's defaults (metrics, grad norm, finite check, summaries,
    the arrays resident in device memory: --input_mode=auto); its own throughput, host work between
    loops included, first (tracing) loop excluded. And the engine fed by its tf.data pipeline
    (--input_mode=distribute_dataset), and with --on_nonfinite=skip, whose update waits for the
    finite check (what a guarded update costs).
  * `model.fit` on the same model, loss, optimizer and tf.data pipeline, at steps_per_execution 1
    (its default) and at the best of 1/10/100/1,000 (up to the engine's steps per loop; the sweep
    only picks the setting, every round then times fit at it afresh).
  Each round times every one of these once (round_order: the bare step, on batches in turn, the
  engine and fit best back to back, in alternating order), so a burst of background load hits all
  alike; ratios are taken within a round and summarised (median, lowest, highest) over 3 rounds
  (--rounds; 1 with --quick). `--json=FILE` keeps every figure; `python -m benchmarks.models_table
  FILE` regenerates the docs' table from it.
  * training FLOPs per example, counted by TensorFlow's profiler on the bare step's graph, so the
    achieved FLOP/s against the device's float32 matmul peak.
  * the peak RSS of a whole `python run.py` process training the model (a user's figure).
And from the parameter count and the measured step time: the bytes all-reduced per step and the
predicted scaling efficiency at stated link bandwidths (models_table.AT_SCALE_LINKS; docs/performance.md "At scale").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# On GPUs: each process (this one, every model's child, run.py for the RSS) takes GPU memory as it
# needs it, instead of the whole device at start-up, which would leave none to the next process.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import measure, models_table  # noqa: E402
from engine.config import Config  # noqa: E402
from engine.controller import job  # noqa: E402
from engine.controller.state import create_state  # noqa: E402
from engine.controller.trainer import train  # noqa: E402
from engine.loop import LoopOptions, make_train_loop  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_FILE = "text.txt"  # the language model's data, written into the work directory
BATCHES_IN_TURN = 64  # distinct batches the "bare, in turn" step cycles through (800 KB each on mlp)


@dataclasses.dataclass(frozen=True)
class Workload:
    flags: dict  # Config fields (the same names as run.py's flags)
    batch: int  # global batch
    note: str


WORKLOADS = {
    "mlp": Workload(dict(model="mlp"), 256, "28x28 synthetic; a tiny step: dispatch dominates"),
    "cnn": Workload(dict(model="cnn"), 256, "28x28 synthetic; the seed CNN"),
    "cnn_bn": Workload(dict(model="cnn_bn"), 256, "28x28 synthetic; 2 conv blocks, synchronised BN, dropout"),
    "resnet20": Workload(
        dict(model="resnet20", synthetic_shape="32,32,3", synthetic_train_examples=10000, synthetic_test_examples=2000),
        128,
        "32x32x3 synthetic; CIFAR ResNet-20",
    ),
    "language_model": Workload(
        dict(task="language_model", seq_len=128), 32, "byte Transformer, 128 tokens per example, 1 MB of text"
    ),
}


def config_for(name: str, workdir: str, **changes) -> Config:
    workload = WORKLOADS[name]
    flags = dict(workload.flags)
    if flags.get("task") == "language_model":
        flags["dataset"] = "text:" + os.path.join(workdir, TEXT_FILE)
    else:
        flags.setdefault("dataset", "synthetic")
    return Config(
        global_batch=workload.batch,
        seed=1,
        export=False,
        eval_every=10**9,
        checkpoint_every=10**9,
        model_dir=tempfile.mkdtemp(prefix="bench_", dir=workdir),
        **flags,
        **changes,
    )


def write_text(path: str, size: int = 1 << 20) -> None:
    """Deterministic English-like text (words of a small vocabulary, sentences, lines)."""
    words = (
        "the of and to in is was he for it with as his on be at by had are but from or have an they "
        "which one you were all her she there would their we him been has when who will no more if out "
        "so up said what its about than into them can only other time new some could these two may first "
        "then do any like my now over such our man me even most made after also did many off before "
        "must well back through years much where your way down should because long each just"
    ).split()
    rng = np.random.default_rng(0)
    chunks, total = [], 0
    while total < size:
        sentence = " ".join(rng.choice(words, rng.integers(4, 14))).capitalize() + ". "
        chunks.append(sentence + ("\n" if rng.random() < 0.2 else ""))
        total += len(chunks[-1])
    with open(path, "w") as f:
        f.write("".join(chunks)[:size])


# ---------------------------------------------------------------- one model, in its own process
def bare_step(task, model, optimizer, features, labels, with_norm: bool = False):
    """One training step with nothing around it; the loss is the per-example (per-token) losses
    summed over the batch over the number of real targets (labels >= 0), as the engine's tasks do.
    with_norm: the gradients' global norm is added to the result (what the engine's finite check
    reads each step; benchmarks/step_costs.py)."""
    with tf.GradientTape() as tape:
        outputs = model(features, training=True)
        loss = tf.reduce_sum(task.per_example_loss(labels, outputs))
        loss /= tf.maximum(tf.reduce_sum(tf.cast(labels >= 0, tf.float32)), 1.0)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss + tf.linalg.global_norm(gradients) if with_norm else loss


def batches_in_turn(data, batch: int, count: int = BATCHES_IN_TURN):
    """(the first batch, next_batch): `count` distinct batches of the data held in memory, and a
    function for compiled loops that returns the next of them in turn. The bare step on them meets a
    batch its cache did not just hold, as any training on data does, with nothing gathered, copied or
    piped: the ceiling of training on data (on a sub-millisecond step the constant batch's cache
    makes the bare step faster than that; docs/performance.md "Where an engine step's time goes")."""
    taken = list(itertools.islice(iter(data.train_dataset(batch, seed=1)), count))
    stacked = [tf.stack([b[i] for b in taken]) for i in (0, 1)]
    position = tf.Variable(0, dtype=tf.int32, trainable=False)

    def next_batch():
        k = position.assign_add(1) % count
        return stacked[0][k], stacked[1][k]

    return taken[0], next_batch


def fresh_task(config, task_class, data):
    task = task_class(config, spec=data.spec)
    task.total_steps = 10**6
    return task, task.build_model(), task.build_optimizer()


class _ConstantBatch:
    """An iterator the compiled loop reads at trace time: every step gets the same batch."""

    def __init__(self, batch):
        self.batch = batch

    def __next__(self):
        return self.batch


def engine_task(config, task_class, data) -> tuple:
    """(task, state): a fresh Task built as train() builds it (model, optimizer, updater, counters),
    in the current strategy's scope, checkpointing into a fresh directory under the run's."""
    task = task_class(config, spec=data.spec)
    task.total_steps = 10**6
    state = create_state(
        tf.distribute.get_strategy(),
        task,
        seed=1,
        is_chief=True,
        keep=1,
        model_dir=tempfile.mkdtemp(prefix="loop_", dir=config.model_dir),
    )
    return task, state


def engine_loop_timer(config, task_class, data, batch, steps: int, iterator=None):
    """Seconds per step of the engine's compiled training loop (the Task's train_step, the update
    with its finite check and gradient norm, the metrics' reduction, the step counter) on one
    constant batch, as train() builds it: the engine without its input, against the bare step.
    iterator: what the loop reads its batches from instead (e.g. a resident data iterator)."""
    strategy = tf.distribute.get_strategy()
    task, state = engine_task(config, task_class, data)
    loop = make_train_loop(strategy, task, state.global_step, LoopOptions.from_config(config))
    iterator = _ConstantBatch(batch) if iterator is None else iterator
    return measure.steps_timer(lambda n: loop(iterator, tf.constant(n))["steps"].numpy(), steps)


def fit_rate(config, task_class, data, steps_per_execution, steps, epochs) -> float:
    gc.collect()  # the earlier measurements' models and graphs: not this run's time
    task, model, optimizer = fresh_task(config, task_class, data)
    sequences = data.spec.labels.shape.rank > 0  # per-token targets: padding (-1) is ignored, as the task does
    model.compile(
        optimizer=optimizer,
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1 if sequences else None),
    )
    return measure.fit_examples_per_sec(
        model, data.train_dataset(config.global_batch, seed=1), config.global_batch, steps, epochs
    )


# The measurements of one round; every round runs each once. Those the judged ratios pair (engine /
# bare, engine / bare in turn, engine / fit best) run back to back in alternating order
# (measure.alternated): this machine's speed drifts over tens of seconds (benchmarks/drift.py,
# docs/performance.md), so measurements far apart in a round pair different speeds. The others follow.
PAIRED = ("bare", "bare in turn", "engine", "fit best")
OTHERS = ("fed", "engine loop", "engine pipeline", "engine guarded", "fit default")
ROUND = PAIRED + OTHERS


def round_order(index: int) -> tuple:
    """The order of round `index`'s measurements (0-based)."""
    return measure.alternated(PAIRED, index) + OTHERS


def measure_model(name: str, workdir: str, quick: bool, num_rounds: int = 3) -> dict:
    config = config_for(name, workdir)
    task_class, data, _ = job.load_data(config)
    batch = config.global_batch
    # The constant batch is the first of the batches the bare step also takes in turn (read once).
    (features, labels), next_in_turn = batches_in_turn(data, batch)

    # The ceiling, and the step time that sizes everything else.
    task, model, optimizer = fresh_task(config, task_class, data)
    optimizer.build(model.trainable_variables)
    step = tf.function(lambda x, y: bare_step(task, model, optimizer, x, y))
    flops = measure.graph_flops(step, features, labels)
    rough = measure.seconds_per_call(lambda: step(features, labels), calls=3, timings=1)
    if rough < 0.1:  # a fast step: the best of 3 timings of about 0.3 s, so the choices below hold from run to run
        rough = measure.seconds_per_call(lambda: step(features, labels), calls=math.ceil(0.3 / rough), timings=3)
    # Each timing is one compiled loop of about 3 s (1 s quick): long enough that the call's own
    # cost and a stray pause (garbage collection of an earlier run's graphs) stay below 1 %.
    calls = max(5, round((1.0 if quick else 3.0) / rough))

    def fresh_timer(key: str):
        """A timer of the bare step, the same step fed by the engine's input pipeline (next() inside
        the compiled loop) or the engine's loop on the constant batch, on a fresh model, optimizer
        and traces, built right before it is timed, as every engine and fit run is: one compiled
        loop kept for the whole process drifted far more from round to round than fresh runs did
        (docs/performance.md, "How steady is the machine")."""
        if key == "engine loop":
            return engine_loop_timer(config, task_class, data, (features, labels), calls)
        task, model, optimizer = fresh_task(config, task_class, data)
        optimizer.build(model.trainable_variables)
        if key == "bare":
            return measure.call_timer(lambda: bare_step(task, model, optimizer, features, labels), calls)
        if key == "bare in turn":
            return measure.call_timer(lambda: bare_step(task, model, optimizer, *next_in_turn()), calls)
        iterator = iter(data.train_dataset(batch, seed=1))
        return measure.call_timer(lambda: bare_step(task, model, optimizer, *next(iterator)), calls)

    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    gradient_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.trainable_variables)

    # Loops of about 0.4 s or more, so the host's work between loops (the call, metric reads, the
    # scalar write, progress: docs/performance.md) stays near 1 % of a loop as it is for a user who
    # sizes --steps_per_loop to the step (docs/runs.md): 1,000 steps per loop for steps under 2 ms,
    # 100 under 25 ms, 10 for slower ones (thresholds chosen far from the five models' CPU step
    # times, so a run's noise does not flip a model's loop length). fit's steps_per_execution is
    # swept up to the same number, so both amortise their per-call costs over equally long calls.
    spl = 1000 if rough < 0.002 else 100 if rough < 0.025 else 10
    loops = max(2, math.ceil((1.5 if quick else 4.0) / (spl * rough)))
    steps = spl * loops  # timed steps per engine run and per fit epoch
    engine_config = config.replace(steps_per_loop=spl, train_steps=spl * (loops + 1))
    fit_epochs = 1 if quick else 2

    def engine_rate(**changes):
        run_config = engine_config.replace(model_dir=tempfile.mkdtemp(prefix="bench_", dir=workdir), **changes)
        gc.collect()  # the earlier measurements' models and graphs: not this run's time
        return train(run_config, out=open(os.devnull, "w")).train_examples_per_sec

    # fit's steps_per_execution sweep only chooses the best setting: its winner's figure is the
    # highest of 2-3 noisy draws, which taken as a round's "fit best" would favour fit in that round.
    # Then every round times each measurement once, in round_order, so a burst of load hits all of
    # them alike, and the ratios are taken within a round (paired), then summarised over the rounds.
    sweep = {
        spe: fit_rate(config, task_class, data, spe, steps, fit_epochs) for spe in (1, 10, 100, 1000) if spe <= spl
    }
    best_spe = max(sweep, key=sweep.get)
    measure_once = {  # examples/s of one timing of each measurement, built afresh
        **{key: lambda key=key: batch / fresh_timer(key)() for key in ("bare", "bare in turn", "fed", "engine loop")},
        "engine": engine_rate,
        "engine pipeline": lambda: engine_rate(input_mode="distribute_dataset"),
        "engine guarded": lambda: engine_rate(on_nonfinite="skip"),
        "fit best": lambda: fit_rate(config, task_class, data, best_spe, steps, fit_epochs),
        "fit default": lambda: fit_rate(config, task_class, data, 1, steps, fit_epochs),
    }
    rounds = []
    for index in range(1 if quick else num_rounds):
        measured = {}
        for key in round_order(index):
            measured[key] = measured["fit best"] if key == "fit default" and best_spe == 1 else measure_once[key]()
        rounds.append(measured)
    column = {key: [r[key] for r in rounds] for key in ROUND}
    return dict(
        model=name,
        batch=batch,
        parameters=parameters,
        gradient_bytes=gradient_bytes,
        flops_per_example=flops / batch,
        best_spe=best_spe,
        steps_per_loop=spl,
        sweep=sweep,
        rounds=rounds,
        medians={key: statistics.median(values) for key, values in column.items()},
        ratios={
            "engine / bare": measure.spread([r["engine"] / r["bare"] for r in rounds]),
            "engine / bare in turn": measure.spread([r["engine"] / r["bare in turn"] for r in rounds]),
            "engine / fit best": measure.spread([r["engine"] / r["fit best"] for r in rounds]),
            "engine / fit default": measure.spread([r["engine"] / r["fit default"] for r in rounds]),
            "pipeline / bare": measure.spread([r["engine pipeline"] / r["bare"] for r in rounds]),
            "pipeline / fit best": measure.spread([r["engine pipeline"] / r["fit best"] for r in rounds]),
            "fed / bare": measure.spread([r["fed"] / r["bare"] for r in rounds]),
            "loop / bare": measure.spread([r["engine loop"] / r["bare"] for r in rounds]),
            "guarded / engine": measure.spread([r["engine guarded"] / r["engine"] for r in rounds]),
        },
    )


# ---------------------------------------------------------------- the parent: children, tables
def peak_rss(name: str, workdir: str, steps_per_loop: int) -> int:
    """Peak RSS (bytes) of `python run.py` training the model for 2 loops and evaluating once."""
    config = config_for(name, workdir)
    wanted = dict(
        WORKLOADS[name].flags,
        dataset=config.dataset,
        global_batch=config.global_batch,
        seed=1,
        model_dir=config.model_dir,
        steps_per_loop=steps_per_loop,
        train_steps=2 * steps_per_loop,
        summaries="basic",
    )
    command = [sys.executable, os.path.join(REPO, "run.py"), "--noexport"] + [f"--{k}={v}" for k, v in wanted.items()]
    code, rss, output = measure.run_peak_rss_bytes(command, cwd=REPO)
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} exited {code}:\n{output[-2000:]}")
    return rss


def child(name: str, workdir: str, quick: bool, rounds: int) -> dict:
    """Runs one model's measurements in a fresh process; its result dict."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.models",
        f"--child={name}",
        f"--workdir={workdir}",
        f"--rounds={rounds}",
    ]
    if quick:
        command.append("--quick")
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def print_tables(report: dict) -> None:
    results, peak = report["results"], report["peak"]
    print("\n1. engine against its ceiling and against model.fit (its verdict on the targets under the table)")
    print(
        "   bare: the compiled step on one constant batch; + input: fed by the engine's tf.data pipeline; "
        "engine loop, no input: the engine's compiled loop on the bare step's constant batch; "
        "engine: its defaults (arrays resident) at --steps_per_loop (steps / loop); pipeline: "
        "--input_mode=distribute_dataset; guarded: --on_nonfinite=skip (the update waits for the finite check)\n"
    )
    print(models_table.engine_table(report))
    print("   (every round's figures: --json)")

    print(f"\n2. achieved FLOP/s against the float32 matmul peak ({peak / 1e9:,.1f} GFLOP/s) and memory")
    print(
        f"   {'model':15s} {'parameters':>10s} {'MFLOP/example':>13s} {'engine GFLOP/s':>14s} "
        f"{'of peak':>7s} {'bare of peak':>12s} {'peak RSS':>9s}"
    )
    for r in results:
        achieved = r["medians"]["engine"] * r["flops_per_example"]
        print(
            f"   {r['model']:15s} {r['parameters']:>10,d} {r['flops_per_example'] / 1e6:>13,.2f} "
            f"{achieved / 1e9:>14,.1f} {achieved / peak:>7.1%} "
            f"{r['medians']['bare'] * r['flops_per_example'] / peak:>12.1%} "
            f"{r['peak_rss'] / 2**20:>6,.0f} MiB"
        )

    print(
        "\n3. at scale, on paper: predicted efficiency t_step / (t_step + t_allreduce) with the step time "
        "measured here (per replica, whole batch); links and formula: benchmarks/models_table.py\n"
    )
    print(models_table.at_scale_table(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds per model; 1 with --quick",
    )
    parser.add_argument("--json", help="also write every result to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure_model(args.child, args.workdir, args.quick, args.rounds)), flush=True)
        return
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: give 1 or more")
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")

    started = time.perf_counter()
    print(f"device: {measure.device_description()}; TensorFlow {tf.__version__}, Keras {keras.__version__}")
    peak = measure.matmul_peak_flops()
    line = f"float32 matmul peak {peak / 1e9:,.1f} GFLOP/s"
    if measure.gpus():
        line += f"; bfloat16 {measure.matmul_peak_flops(tf.bfloat16) / 1e12:,.1f} TFLOP/s"
    print(line)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_models_") as workdir:
        write_text(os.path.join(workdir, TEXT_FILE))
        for name in names:
            print(f"{name}: {WORKLOADS[name].note} ...", flush=True)
            result = child(name, workdir, args.quick, args.rounds)
            result["peak_rss"] = peak_rss(name, workdir, result["steps_per_loop"])
            results.append(result)
    report = dict(
        device=measure.device_description(),
        peak=peak,
        results=results,
        versions=f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        seconds=round(time.perf_counter() - started),
    )
    print_tables(report)
    print(f"\n(whole benchmark {report['seconds']:,} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"every figure written to {args.json}; the docs' table: python -m benchmarks.models_table {args.json}")


if __name__ == "__main__":
    main()
