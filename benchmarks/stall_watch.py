"""What --stall_timeout costs: the engine's training throughput with the stall watch on (its thread
reads three counters every S/10 s; the compiled loop adds one to a counter per step and per
evaluation batch) and off, interleaved repeats in one process, medians and their ratio.

    python -m benchmarks.stall_watch                 # mlp (the smallest step: the worst case), 5 repeats
    python -m benchmarks.stall_watch --model=cnn --repeats=3

Target: the watch costs under 1 % of step time (ratio >= 0.99, within the spread printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from engine.config import Config  # noqa: E402
from engine.controller.trainer import train  # noqa: E402


def throughput(model: str, stall_timeout: float, workdir: str, run: int) -> float:
    config = Config(
        dataset="synthetic",
        synthetic_train_examples=16384,
        synthetic_test_examples=256,
        model=model,
        global_batch=256,
        train_steps=400 if model == "mlp" else 120,
        steps_per_loop=20,
        seed=1,
        export=False,
        summaries="basic",
        eval_every=-1,
        stall_timeout=stall_timeout,
        model_dir=os.path.join(workdir, f"{model}-{stall_timeout:g}-{run}"),
    )
    return train(config, out=open(os.devnull, "w")).train_examples_per_sec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    on, off = [], []
    with tempfile.TemporaryDirectory() as workdir:
        throughput(args.model, 0.0, workdir, -1)  # warm-up: first-time imports and caches
        for run in range(args.repeats):
            off.append(throughput(args.model, 0.0, workdir, run))
            on.append(throughput(args.model, 10.0, workdir, run))  # reads every second
    ratio = statistics.median(on) / statistics.median(off)
    spread = (max(off) - min(off)) / statistics.median(off)
    print(
        f"{args.model}: examples/s with the stall watch (--stall_timeout=10) {statistics.median(on):,.0f}, without "
        f"{statistics.median(off):,.0f}; ratio {ratio:.3f} (repeats {args.repeats}, spread of the runs without: "
        f"{spread:.1%}); target >= 0.99"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
