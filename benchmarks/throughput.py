"""Throughput benchmark: the engine against Keras `model.fit`, the matmul peak, a sweep of
`--steps_per_loop` and replica counts, and the time to the first finished loop.

    python -m benchmarks.throughput            # its run time and results: docs/performance.md
    python -m benchmarks.throughput --quick    # fewer steps and repeats (a smoke run)

Everything is measured in ONE process run, on the same model (the seed CNN), the same in-memory
data (synthetic, MNIST-shaped, 60,000 examples) and the same global batch (256), and printed as
ratios of numbers measured here and now. Engine and fit alternate over several timed repeats
after a warm-up; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from engine.distribute.strategy import configure_cpu_replicas  # noqa: E402

configure_cpu_replicas(2)  # before TensorFlow starts: the sweep compares 1 and 2 replicas

import keras  # noqa: E402

from benchmarks import measure, whole_process  # noqa: E402
from engine.data import sources  # noqa: E402
from engine.config import Config  # noqa: E402
from engine.models.registry import build_model  # noqa: E402
from engine.controller.trainer import train  # noqa: E402

GLOBAL_BATCH = 256


def engine_examples_per_sec(
    steps_per_loop: int, loops: int, strategy="default", cpu_replicas=1, precision="float32"
) -> float:
    """Median-free single measurement: the trainer's own throughput, first (tracing) loop excluded."""
    config = Config(
        strategy=strategy,
        cpu_replicas=cpu_replicas,
        dataset="synthetic",
        model="cnn",
        precision=precision,
        global_batch=GLOBAL_BATCH,
        steps_per_loop=steps_per_loop,
        train_steps=steps_per_loop * (loops + 1),
        eval_every=10**9,
        checkpoint_every=10**9,
        seed=1,
        export=False,
        model_dir=tempfile.mkdtemp(prefix="bench_engine_"),
    )
    return train(config, out=open(os.devnull, "w")).train_examples_per_sec


def fit_examples_per_sec(steps_per_execution: int, steps: int, epochs: int, precision="float32") -> float:
    """Keras model.fit on the same model, data pipeline and batch; the first epoch is warm-up."""
    data = sources.load(Config(dataset="synthetic"))
    dataset = data.train_dataset(GLOBAL_BATCH, seed=1)
    keras.mixed_precision.set_dtype_policy(precision)
    model = build_model("cnn", data.spec.input_shape, data.spec.num_classes)
    keras.mixed_precision.set_dtype_policy("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return measure.fit_examples_per_sec(model, dataset, GLOBAL_BATCH, steps, epochs)


def step_parts() -> dict:
    """Where the time of the bare step goes: {part: (seconds per step, training FLOPs or None)},
    each part compiled alone on constant inputs (the profile behind the FLOP/s target). The whole
    bare step (constant batch, no input pipeline, no strategy, no metrics) is the ceiling: what the
    engine would reach with zero overhead."""
    model = build_model("cnn", (28, 28, 1), 10)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    conv, pool, dense, logits_layer = (model.get_layer(index=i) for i in (0, 1, 3, 4))
    images = tf.random.uniform([GLOBAL_BATCH, 28, 28, 1])
    labels = tf.random.uniform([GLOBAL_BATCH], 0, 10, tf.int32)
    flat = tf.random.uniform([GLOBAL_BATCH, dense.input.shape[-1]])
    gradients = [tf.random.normal(v.shape) * 1e-3 for v in model.trainable_variables]

    def full():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, model(images, training=True), from_logits=True)
            )
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def conv_block():  # conv 3x3 + bias + relu + max-pool, forward and backward (kernel gradient)
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(pool(conv(images)))
        return out + tf.reduce_sum(tape.gradient(out, conv.kernel))

    def dense_block():  # dense 5408 -> 128 -> 10, forward and backward (input and weight gradients)
        with tf.GradientTape() as tape:
            tape.watch(flat)
            out = tf.reduce_sum(logits_layer(dense(flat)))
        grads = tape.gradient(out, [flat, dense.kernel, logits_layer.kernel])
        return out + tf.reduce_sum(grads[1])

    def adam():
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return tf.constant(0.0)

    conv_flops = 3 * 2 * 26 * 26 * 9 * 32 * GLOBAL_BATCH
    dense_flops = 3 * 2 * (dense.input.shape[-1] * 128 + 128 * 10) * GLOBAL_BATCH
    return {
        "whole bare step": (measure.seconds_per_call(full), training_flops_per_example(model) * GLOBAL_BATCH),
        "conv 3x3 + relu + max-pool (fwd+bwd)": (measure.seconds_per_call(conv_block), conv_flops),
        "dense 5408>128>10 (fwd+bwd)": (measure.seconds_per_call(dense_block), dense_flops),
        "Adam update (all weights)": (measure.seconds_per_call(adam), None),
    }


def training_flops_per_example(model) -> float:
    """Forward FLOPs (2 per multiply-add) of Conv2D and Dense layers, times 3 for training
    (the backward pass costs about twice the forward: gradients for inputs and for weights)."""
    forward = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            _, h, w, c_out = layer.output.shape
            kh, kw = layer.kernel_size
            forward += 2 * h * w * kh * kw * layer.input.shape[-1] * c_out
        elif isinstance(layer, keras.layers.Dense):
            forward += 2 * layer.input.shape[-1] * layer.units
    return 3.0 * forward


def seconds_to_first_loop() -> float:
    """Process start to the first progress line of a fresh `python run.py` (imports included)."""
    with tempfile.TemporaryDirectory() as model_dir:
        run = whole_process.run_process(
            [
                "run.py",
                "--dataset=synthetic",
                "--train_steps=10",
                "--steps_per_loop=10",
                f"--model_dir={model_dir}",
                "--seed=1",
                "--noexport",
            ],
            whole_process.ENGINE_DONE,
            first_pattern=whole_process.ENGINE_PROGRESS,
        )
    return run["first"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args()
    loops, repeats, fit_steps = (2, 1, 100) if args.quick else (3, 3, 300)

    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}, Keras {keras.__version__}")
    print(f"workload: seed CNN, synthetic 60,000 x 28x28 in memory, global batch {GLOBAL_BATCH}\n")

    print("1. engine vs model.fit (1 replica, default strategy)")
    fit_best = {}
    for spe in (1, 10, 100):
        fit_best[spe] = fit_examples_per_sec(spe, fit_steps, epochs=2 if args.quick else 3)
        print(f"   fit steps_per_execution={spe:<4} {fit_best[spe]:>9,.0f} ex/s")
    best_spe = max(fit_best, key=fit_best.get)
    engine_runs, fit_runs = [], []
    for _ in range(repeats):  # alternate, so drifts in machine load hit both alike
        engine_runs.append(engine_examples_per_sec(100, loops))
        fit_runs.append(fit_examples_per_sec(best_spe, fit_steps, epochs=2))
    engine_median, fit_median = statistics.median(engine_runs), statistics.median(fit_runs)
    print(f"   engine steps_per_loop=100 {engine_median:>9,.0f} ex/s (median of {repeats})")
    print(f"   fit steps_per_execution={best_spe} {fit_median:>9,.0f} ex/s (median of {repeats})")
    print(f"   ratio engine / fit = {engine_median / fit_median:.2f} (target >= 1.5)")
    bf16 = statistics.median(engine_examples_per_sec(100, loops, precision="mixed_bfloat16") for _ in range(repeats))
    fit_bf16 = fit_examples_per_sec(best_spe, fit_steps, epochs=2, precision="mixed_bfloat16")
    print(
        f"   engine --precision=mixed_bfloat16 {bf16:>9,.0f} ex/s (median of {repeats}) = "
        f"{bf16 / fit_median:.2f} x fit float32; fit under the same Keras policy {fit_bf16:,.0f} ex/s\n"
    )

    print("2. achieved FLOP/s against the float32 matmul peak")
    peak = measure.matmul_peak_flops()
    per_example = training_flops_per_example(build_model("cnn", (28, 28, 1), 10))
    achieved = engine_median * per_example
    print(f"   matmul peak {peak / 1e9:,.1f} GFLOP/s; CNN training {per_example / 1e6:.2f} MFLOP/example")
    print(f"   engine {achieved / 1e9:,.1f} GFLOP/s = {achieved / peak:.1%} of peak (target >= 50%)")
    parts = step_parts()
    whole = parts["whole bare step"][0]
    bare = GLOBAL_BATCH / whole
    print(
        f"   ceiling: the bare compiled step (constant batch, no pipeline/strategy/metrics) "
        f"{bare:,.0f} ex/s = {bare * per_example / peak:.1%} of peak; engine = {engine_median / bare:.2f} of it"
    )
    print("   where the bare step's time goes (each part compiled alone):")
    for name, (seconds, flops) in parts.items():
        rate = f"{flops / seconds / 1e9:6.1f} GFLOP/s = {flops / seconds / peak:4.0%} of peak" if flops else " " * 29
        print(f"     {name:38s} {seconds * 1e3:6.2f} ms {rate}  {seconds / whole:4.0%} of the step")
    print()

    print("3. steps_per_loop x replicas (examples/s)")

    def cell(spl, replicas):  # about 300 timed steps
        return engine_examples_per_sec(spl, max(loops, 300 // spl), strategy="mirrored", cpu_replicas=replicas)

    table = {(spl, replicas): cell(spl, replicas) for replicas in (1, 2) for spl in (1, 10, 100)}
    # The target's two cells: alternating repeats, medians (single runs vary too much to judge alone).
    for spl in (1, 100):
        runs = [table[spl, 1]]
        for _ in range(repeats - 1):
            runs.append(cell(spl, 1))
        table[spl, 1] = statistics.median(runs)
    print("   steps_per_loop   1 replica   2 replicas")
    for spl in (1, 10, 100):
        print(f"   {spl:>14} {table[spl, 1]:>11,.0f} {table[spl, 2]:>12,.0f}")
    print(
        f"   ratio steps_per_loop 100 / 1 (1 replica, medians of {repeats}) = "
        f"{table[100, 1] / table[1, 1]:.2f} (target >= 1.2)\n"
    )

    print("4. time to first step")
    first = seconds_to_first_loop()
    print(f"   process start to the first finished loop: {first:.1f} s (target < 8 s)")


if __name__ == "__main__":
    main()
