"""Whole-process time to a result: the README's Fashion-MNIST command against the textbook Keras
`model.fit` program doing the same job (benchmarks/fit_program.py), each timed from process start
to process exit, the figure a user feels.

    python -m benchmarks.whole_process              # 3 runs of each
    python -m benchmarks.whole_process --runs=5
    python -m benchmarks.whole_process --quick      # 1 epoch, 1 run of each (a smoke run)

Needs the Fashion-MNIST IDX files (Debian's dataset-fashion-mnist). The two programs alternate
(a, b, a, b, ...) so drifts in machine load hit both alike; medians are reported, and ratios of
numbers measured in this run. For run.py it also reports the time from process start to its first
progress line (the first finished compiled loop of 100 steps) and to the end of the first epoch;
for the fit program, to the end of its first epoch (Keras' first per-epoch line).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README's command (its flags kept as they are), plus a fresh --model_dir and a fixed seed.
README_COMMAND = ["run.py", "--strategy=mirrored", "--cpu_replicas=2", "--global_batch=256", "--dataset=fashion_mnist"]
FIT_COMMAND = ["-m", "benchmarks.fit_program"]

ENGINE_PROGRESS = re.compile(r"epoch +([0-9.]+) +step")
ENGINE_DONE = re.compile(r"^done +test loss ([0-9.]+) +accuracy ([0-9.]+)")
_FIT_EPOCH = re.compile(r"^\d+/\d+ - ")  # Keras' verbose=2 line at the end of an epoch
_FIT_DONE = re.compile(r"^test loss ([0-9.]+) +accuracy ([0-9.]+)")


def run_process(argv, done_pattern, first_pattern=None, epoch_pattern=None):
    """Runs `python argv...` in the repository root; returns {wall, first, epoch, epochs, result,
    accuracy, loss} with times in seconds from the Popen call (process start) to the event: its exit
    (wall), its first progress line, the end of its first epoch (of each epoch), the line with its
    test accuracy."""
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *argv], cwd=REPO, env=environment, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    result = {"first": None, "epoch": None, "epochs": [], "result": None, "accuracy": None, "loss": None}
    tail = []
    for line in process.stdout:
        now = time.perf_counter() - start
        tail = (tail + [line])[-30:]
        if first_pattern and result["first"] is None and first_pattern.search(line):
            result["first"] = now
        if epoch_pattern and epoch_pattern(line):
            result["epochs"].append(now)
            result["epoch"] = result["epochs"][0]
        found = done_pattern.search(line)
        if found:
            result["loss"], result["accuracy"] = float(found.group(1)), float(found.group(2))
            result["result"] = now
    code = process.wait()
    result["wall"] = time.perf_counter() - start
    if code != 0 or result["accuracy"] is None:
        raise SystemExit(f"{' '.join(argv)} failed (exit {code}):\n{''.join(tail)}")
    return result


def _engine_epoch_done(line):
    found = ENGINE_PROGRESS.search(line)
    return bool(found) and float(found.group(1)) >= 1.0 and float(found.group(1)).is_integer()


def engine_run(epochs: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="whole_process_") as model_dir:
        return run_process(
            [*README_COMMAND, f"--epochs={epochs}", f"--model_dir={model_dir}", f"--seed={seed}"],
            ENGINE_DONE,
            first_pattern=ENGINE_PROGRESS,
            epoch_pattern=_engine_epoch_done,
        )


def fit_run(epochs: int, seed: int, extra=()) -> dict:
    return run_process(
        [*FIT_COMMAND, f"--epochs={epochs}", f"--seed={seed}", *extra], _FIT_DONE, epoch_pattern=_FIT_EPOCH.search
    )


def _epoch_ends(run) -> str:
    return "epochs end at " + ", ".join(f"{t:.1f}" for t in run["epochs"]) + " s"


def _median(runs, key):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each program (interleaved)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 run of each, 1 epoch")
    parser.add_argument("--fit_flags", default="", help="extra flags for fit_program.py, e.g. --no_autotune")
    args = parser.parse_args()
    fit_flags = args.fit_flags.split()
    runs, epochs = (1, 1) if args.quick else (args.runs, args.epochs)

    print(f"machine: {os.cpu_count()} CPU cores; {runs} run(s) of each, {epochs} epoch(s), seed {args.seed}")
    print(f"a: python {' '.join(README_COMMAND)} --epochs={epochs} --model_dir=<tmp> --seed={args.seed}")
    print(f"b: python {' '.join(FIT_COMMAND)} --epochs={epochs} --seed={args.seed} {args.fit_flags}\n")
    engine, fit = [], []
    for i in range(runs):  # a, b, a, b, ...
        engine.append(engine_run(epochs, args.seed))
        r = engine[-1]
        print(
            f"run {i + 1} a: wall {r['wall']:6.2f} s  first loop {r['first']:5.2f} s  epoch 1 {r['epoch']:6.2f} s  "
            f"result {r['result']:6.2f} s  test accuracy {r['accuracy']:.4f}  {_epoch_ends(r)}",
            flush=True,
        )
        fit.append(fit_run(epochs, args.seed, fit_flags))
        r = fit[-1]
        print(
            f"run {i + 1} b: wall {r['wall']:6.2f} s  {'':17s}  epoch 1 {r['epoch']:6.2f} s  "
            f"result {r['result']:6.2f} s  test accuracy {r['accuracy']:.4f}  {_epoch_ends(r)}",
            flush=True,
        )

    print(f"\nmedians of {runs} run(s), seconds from process start")
    print("                        a: run.py   b: fit program   a / b")
    for label, key in (("wall time to exit", "wall"), ("test accuracy printed", "result"), ("end of epoch 1", "epoch")):
        a, b = _median(engine, key), _median(fit, key)
        print(f"  {label:21s} {a:10.2f} {b:16.2f} {a / b:8.2f}")
    print(
        f"  {'exit after the result':21s} {_median(engine, 'wall') - _median(engine, 'result'):10.2f} "
        f"{_median(fit, 'wall') - _median(fit, 'result'):16.2f}"
    )
    print(f"  {'first finished loop':21s} {_median(engine, 'first'):10.2f} {'-':>16s}          (target < 8 s)")
    print(f"  {'test accuracy':21s} {_median(engine, 'accuracy'):10.4f} {_median(fit, 'accuracy'):16.4f}")
    each = {name: ", ".join(f"{r['accuracy']:.4f}" for r in runs_) for name, runs_ in (("a", engine), ("b", fit))}
    print(f"  test accuracy of each run: a {each['a']}; b {each['b']}")


if __name__ == "__main__":
    main()
