"""Each source's input pipeline alone against the training step it feeds, on the same data.

    python -m benchmarks.input_pipelines              # its run time and results: docs/performance.md
    python -m benchmarks.input_pipelines --quick      # a smoke run

The same 20,000 32x32x3 uint8 images with labels, stored three ways: an npz (in memory), a folder
of PNG files (`images:`), TFRecord shards (`tfrecord:`, PNG-encoded in the default schema, and
`tfrecord_raw`: the same as serialized uint8 tensors, `write_shards(..., png=False)`). For
each: the engine's training pipeline alone (global batch 256, one input pipeline), batches/s after
a warm-up, against the engine's training step rate on the same data (the seed `cnn` and `mlp`,
one replica, measured by a short run). A ratio above 1 means the input keeps up with the step.
Then the engine training the cnn from each stored form (240 steps a run: shorter runs swung too
far from round to round to compare), interleaved over 5 rounds (in memory and raw-tensor TFRecords back to back, in
alternating order): TFRecords decoded a batch at a time (the engine) and record by record (as
before), tf.data autotuning of the engine's pipelines on and off (engine/data/formats.AUTOTUNE_PIPELINES),
TFRecords read into memory at start-up (--input_mode=resident), and in-memory data through a
tf.data pipeline (--input_mode=distribute_dataset), each against in memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import measure, models_table  # noqa: E402
from engine.config import Config  # noqa: E402
from engine.controller.trainer import train  # noqa: E402
from engine.data import builtin, formats, sources, tfrecord  # noqa: E402

GLOBAL_BATCH = 256


def write_all(directory: str, count: int) -> dict:
    """{kind: --dataset value} for the same examples as npz, PNG folders and TFRecords."""
    x, y = builtin.synthetic_arrays(count, seed=1, shape=(32, 32, 3))
    xt, yt = builtin.synthetic_arrays(1000, seed=2, shape=(32, 32, 3))
    np.savez(os.path.join(directory, "data.npz"), x_train=x, y_train=y, x_test=xt, y_test=yt)
    for split, images, labels in (("train", x, y), ("test", xt, yt)):
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = os.path.join(directory, "images", split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            tf.io.write_file(os.path.join(folder, f"{i:06d}.png"), tf.io.encode_png(image))
        tfrecord.write_shards(os.path.join(directory, "rec"), split, images, labels, 8)
        tfrecord.write_shards(os.path.join(directory, "raw"), split, images, labels, 8, png=False)
    return {
        "npz": f"npz:{directory}/data.npz",
        "images": f"images:{directory}/images",
        "tfrecord": f"tfrecord:{directory}/rec/train-*,{directory}/rec/test-*",
        "tfrecord_raw": f"tfrecord:{directory}/raw/train-*,{directory}/raw/test-*",
    }


def pipeline_rate(source, batches: int) -> tuple[float, float]:
    """(batches/s, CPU ms a batch) of the source's own training pipeline, one input pipeline, after 5
    warm-up batches, over `batches` batches and at least a second. The CPU time is the whole
    process's (all of tf.data's threads): on a machine with few cores it is what the pipeline takes
    from the step beside it."""
    if source.streamed:
        dataset = source.train_dataset_fn(GLOBAL_BATCH, seed=1)(tf.distribute.InputContext(1, 0, 1))
    else:
        dataset = source.train_dataset(GLOBAL_BATCH, seed=1)
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    start, cpu_start, count = time.perf_counter(), time.process_time(), 0
    while count < batches or time.perf_counter() - start < 1.0:  # at least a second: a steady CPU figure
        next(iterator)
        count += 1
    return count / (time.perf_counter() - start), (time.process_time() - cpu_start) * 1000 / count


def step_rate(dataset: str, model: str, steps: int, directory: str, input_mode: str = "auto") -> float:
    """Training steps/s of the engine on `dataset` (one replica; the first loop, with tracing, left out)."""
    config = Config(
        dataset=dataset,
        model=model,
        global_batch=GLOBAL_BATCH,
        train_steps=steps,
        input_mode=input_mode,
        steps_per_loop=steps // 4,
        summaries="basic",
        export=False,
        seed=1,
        eval_every=steps,
        model_dir=tempfile.mkdtemp(dir=directory),
    )
    return train(config, out=open(os.devnull, "w")).train_examples_per_sec / GLOBAL_BATCH


def trained_rate(
    dataset: str,
    model: str,
    steps: int,
    directory: str,
    autotune: bool = False,
    record_by_record: bool = False,
    input_mode: str = "auto",
) -> float:
    """step_rate with tf.data autotuning of the engine's pipelines on or off, and TFRecords of the
    default schema decoded a batch at a time (the engine's way) or record by record (the old way)."""
    saved = formats.AUTOTUNE_PIPELINES, sources.SOURCE_KINDS["tfrecord"]
    formats.AUTOTUNE_PIPELINES = autotune
    if record_by_record:

        def load_record_by_record(*args):
            source = tfrecord.load(*args)
            source.decode_batch = None
            return source

        sources.SOURCE_KINDS["tfrecord"] = load_record_by_record
    try:
        return step_rate(dataset, model, steps, directory, input_mode)
    finally:
        formats.AUTOTUNE_PIPELINES, sources.SOURCE_KINDS["tfrecord"] = saved


# The engine runs of one round of the cnn comparison: (name, data kind, autotune, record by record,
# --input_mode). The pair the target judges runs back to back in alternating order
# (measure.alternated); the others follow.
CNN_PAIR = (("in memory", "npz", False, False, "auto"), ("TFRecord tensors", "tfrecord_raw", False, False, "auto"))
CNN_OTHERS = (
    ("in memory, autotune", "npz", True, False, "auto"),
    ("in memory, tf.data pipeline", "npz", False, False, "distribute_dataset"),
    ("TFRecord tensors, read into memory", "tfrecord_raw", False, False, "resident"),
    ("TFRecord PNG", "tfrecord", False, False, "auto"),
    ("TFRecord PNG, autotune", "tfrecord", True, False, "auto"),
    ("TFRecord PNG, per record", "tfrecord", False, True, "auto"),
    ("TFRecord PNG, read into memory", "tfrecord", False, False, "resident"),
    ("TFRecord tensors, autotune", "tfrecord_raw", True, False, "auto"),
    ("TFRecord tensors, per record", "tfrecord_raw", False, True, "auto"),
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    count, batches, steps, rounds = (3000, 10, 20, 1) if args.quick else (20000, 60, 240, 5)
    directory = tempfile.mkdtemp(prefix="ctl_input_bench_")
    try:
        start = time.perf_counter()
        datasets = write_all(directory, count)
        print(
            f"data     {count:,} train images 32x32x3 as npz, PNG folders, 8 TFRecord shards "
            f"({time.perf_counter() - start:.0f} s to write)"
        )
        steps_per_sec = {model: step_rate(datasets["npz"], model, steps, directory) for model in ("cnn", "mlp")}
        print(
            "step     "
            + ", ".join(f"{m} {r:.1f} steps/s" for m, r in steps_per_sec.items())
            + " (engine, in-memory npz, one replica)"
        )
        for kind, dataset in datasets.items():
            rate, cpu_ms = pipeline_rate(sources.load(Config(dataset=dataset, shuffle_buffer=2048)), batches)
            print(
                f"{kind:13s}{rate:7.1f} batches/s alone = {rate * GLOBAL_BATCH:9,.0f} examples/s, "
                f"{cpu_ms:5.2f} ms CPU a batch; "
                + ", ".join(f"{rate / r:.2f}x the {m} step" for m, r in steps_per_sec.items())
            )
        # The engine training cnn from each, interleaved over the rounds; ratios paired within a round.
        runs = {name: [] for name, *_ in CNN_PAIR + CNN_OTHERS}
        for index in range(rounds):
            for name, kind, autotune, per_record, input_mode in measure.alternated(CNN_PAIR, index) + CNN_OTHERS:
                runs[name].append(
                    trained_rate(datasets[kind], "cnn", steps, directory, autotune, per_record, input_mode)
                )
        print(
            f"\ntrain cnn (engine, one replica, {steps} steps; medians of {rounds} interleaved round(s); "
            "ratio: to in memory in the same round, median (lowest-highest))"
        )
        for name, rates in runs.items():
            paired = measure.spread([r / m for r, m in zip(rates, runs["in memory"])])
            print(
                f"   {name:36s} {statistics.median(rates) * GLOBAL_BATCH:9,.0f} examples/s  "
                f"{models_table.ratio(paired)}"
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
