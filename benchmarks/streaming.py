"""Streaming benchmark: train from >= 1 GB of TFRecords and report the process's peak RSS, the
input pipeline's rate alone against the training step's rate, and the cost of resuming.

    python -m benchmarks.streaming                 # writes ~1.1 GB under /tmp (results: docs/data.md)
    python -m benchmarks.streaming --gigabytes=0.1 # a smoke run

Examples are 96x96x3 uint8 images stored as serialized tensors (27 KB each), with int labels.
Each phase runs in a fresh process (peak RSS is per process), printed as one line each:
  write    the shards (not timed against anything)
  pipeline the engine's training pipeline alone: batches/s over N batches
  train    run.py on the shards (mlp on 96x96x3, global batch 256): examples/s, peak RSS
  memory   the same model trained from the same number of examples in memory would need
           the data's size in RAM; the stream's RSS stays far below it
  resume   seconds for the pipeline to produce its first batch after skipping S steps
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (96, 96, 3)
GLOBAL_BATCH = 256


def _phase(name, *args):
    """Runs this module's `name` phase in a fresh process; returns its JSON result."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.streaming", f"--phase={name}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write(directory, gigabytes):
    import numpy as np

    from engine.data import tfrecord

    per_example = int(np.prod(SHAPE))
    count = int(gigabytes * 2**30 / per_example)
    rng = np.random.default_rng(0)
    os.makedirs(directory, exist_ok=True)
    chunk = 2048
    writers = {}
    start = time.perf_counter()
    for offset in range(0, count, chunk):  # a chunk at a time: this process's memory stays small too
        n = min(chunk, count - offset)
        x = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
        y = rng.integers(0, 10, n)
        paths = tfrecord.write_shards(os.path.join(directory, f"part{offset // chunk:04d}"), "train", x, y, 1)
        writers[offset] = paths[0]
    tfrecord.write_shards(
        os.path.join(directory, "test"),
        "test",
        rng.integers(0, 256, (512, *SHAPE), dtype=np.uint8),
        rng.integers(0, 10, 512),
        1,
    )
    size = sum(os.path.getsize(p) for p in writers.values())
    return {"examples": count, "bytes": size, "files": len(writers), "seconds": time.perf_counter() - start}


def _source(directory):
    from engine.config import Config
    from engine.data import sources

    return sources.load(Config(dataset=f"tfrecord:{directory}/part*/train-*,{directory}/test/test-*"))


def pipeline(directory, batches, skip):
    import tensorflow as tf

    source = _source(directory)
    context = tf.distribute.InputContext(1, 0, 1)
    start = time.perf_counter()
    iterator = iter(source.train_dataset_fn(GLOBAL_BATCH, seed=1, skip_batches=skip)(context))
    next(iterator)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    return {
        "batches_per_sec": batches / seconds,
        "first_batch_seconds": first,
        "skip": skip,
        "peak_rss_mib": _peak_rss_mib(),
    }


def train(directory, steps):
    from engine.config import Config
    from engine.controller.trainer import train as run

    config = Config(
        dataset=f"tfrecord:{directory}/part*/train-*,{directory}/test/test-*",
        model="mlp",
        global_batch=GLOBAL_BATCH,
        train_steps=steps,
        steps_per_loop=50,
        eval_every=0,
        checkpoint_every=steps,
        summaries="basic",
        export=False,
        seed=1,
        model_dir=os.path.join(directory, "run"),
        shuffle_buffer=2048,
    )
    result = run(config, out=open(os.devnull, "w"))
    return {"examples_per_sec": result.train_examples_per_sec, "steps": steps, "peak_rss_mib": _peak_rss_mib()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gigabytes", type=float, default=1.1)
    parser.add_argument("--dir", default="/tmp/ctl_streaming_bench")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--phase", default="")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.phase == "write":
        print(json.dumps(write(args.dir, args.gigabytes)))
    elif args.phase == "pipeline":
        print(json.dumps(pipeline(args.dir, 100, 0)))
    elif args.phase == "resume":
        print(json.dumps(pipeline(args.dir, 1, args.steps)))
    elif args.phase == "train":
        print(json.dumps(train(args.dir, args.steps)))
    else:
        common = [f"--dir={args.dir}", f"--gigabytes={args.gigabytes}", f"--steps={args.steps}"]
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)
        written = _phase("write", *common)
        print(
            f"write    {written['examples']:,} examples, {written['bytes'] / 2**30:.2f} GiB in "
            f"{written['files']} files ({written['seconds']:.0f} s)"
        )
        alone = _phase("pipeline", *common)
        print(
            f"pipeline {alone['batches_per_sec']:.1f} batches/s of {GLOBAL_BATCH} alone "
            f"({alone['batches_per_sec'] * GLOBAL_BATCH:,.0f} examples/s), peak RSS {alone['peak_rss_mib']:,.0f} MiB"
        )
        trained = _phase("train", *common)
        steps_per_sec = trained["examples_per_sec"] / GLOBAL_BATCH
        print(
            f"train    {trained['examples_per_sec']:,.0f} examples/s = {steps_per_sec:.1f} steps/s over "
            f"{trained['steps']} steps; peak RSS {trained['peak_rss_mib']:,.0f} MiB "
            f"(data on disk {written['bytes'] / 2**20:,.0f} MiB); pipeline / step rate = "
            f"{alone['batches_per_sec'] / steps_per_sec:.2f}"
        )
        resumed = _phase("resume", *common)
        print(
            f"resume   first batch after skipping {resumed['skip']} steps: "
            f"{resumed['first_batch_seconds']:.2f} s (from step 0: {alone['first_batch_seconds']:.2f} s)"
        )
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
