"""Measuring tools the benchmarks share: the device and its matmul peak, a compiled loop's time per
call, a graph's FLOPs, Keras `model.fit` timed per epoch, a child process's peak RSS.

Import TensorFlow's device set-up (e.g. logical CPU replicas) before this module touches a device.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import time

import keras
import tensorflow as tf


def gpus() -> list:
    return tf.config.list_physical_devices("GPU")


def device_description() -> str:
    """'NVIDIA H200 (1 of 1 GPUs)' or '2 CPU cores, Intel(R) Xeon(R) ...' : what the numbers ran on."""
    found = gpus()
    if found:
        details = tf.config.experimental.get_device_details(found[0])
        return f"{details.get('device_name', 'GPU')} (GPU 0 of {len(found)})"
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPU cores, {model}"


def matmul_peak_flops(dtype=tf.float32, n: int | None = None, repeats: int = 20) -> float:
    """FLOP/s of chained square matmuls (2 n^3 FLOPs each) in `dtype`, best of 3 timings, on the
    default device (the first GPU if there is one). n: 2048 on CPUs, 8192 on GPUs (big enough to
    reach the tensor cores' rate). On NVIDIA GPUs TensorFlow runs float32 matmuls as TF32."""
    n = n or (8192 if gpus() else 2048)
    a = tf.cast(tf.random.normal([n, n]), dtype)
    b = tf.cast(tf.random.normal([n, n]) * 1e-2, dtype)

    @tf.function
    def run():
        c = a
        for _ in range(repeats):
            c = tf.matmul(c, b)
        return tf.reduce_sum(tf.cast(c, tf.float32))

    run().numpy()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run().numpy()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * repeats / best


def steps_timer(run_steps, steps: int):
    """A function that times `run_steps(steps)` (one compiled loop of that many steps, synced)
    and returns seconds per step; warmed up once here (tracing), and garbage collected before each
    timing, so an earlier measurement's garbage is not this one's time."""
    run_steps(min(3, steps))

    def time_once() -> float:
        gc.collect()
        start = time.perf_counter()
        run_steps(steps)
        return (time.perf_counter() - start) / steps

    return time_once


def call_timer(body, calls: int = 50):
    """A function that times one compiled loop of `calls` calls of body() and returns seconds per
    call; traced and warmed up once here, so repeated timings (e.g. interleaved with other
    measurements) pay no tracing."""

    @tf.function
    def loop(n):
        out = tf.constant(0.0)
        for _ in tf.range(n):
            out = body()
        return out

    return steps_timer(lambda n: loop(tf.constant(n)).numpy(), calls)


def seconds_per_call(body, calls: int = 50, timings: int = 5) -> float:
    """Best of `timings` timings of one compiled loop of `calls` calls of body(), per call."""
    time_once = call_timer(body, calls)
    return min(time_once() for _ in range(timings))


def alternated(paired: tuple, index: int) -> tuple:
    """`paired` forwards in even rounds and backwards in odd ones (`index` from 0): measurements
    compared with each other run back to back, and a steady drift of the machine's speed
    (benchmarks/drift.py) favours neither side over two rounds."""
    return paired if index % 2 == 0 else paired[::-1]


def spread(values) -> dict:
    """Median, lowest and highest of repeated measurements (e.g. per-round paired ratios)."""
    return dict(median=statistics.median(values), low=min(values), high=max(values))


def graph_flops(function, *args) -> int:
    """Floating-point operations of one call of the tf.function `function` on `args`, counted by
    TensorFlow's profiler over the traced graph (matmuls, convolutions and their gradients,
    elementwise ops; shapes must be static)."""
    graph = function.get_concrete_function(*args).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    return tf.compat.v1.profiler.profile(graph, options=options).total_float_ops


class EpochTimer(keras.callbacks.Callback):
    """Seconds of each `model.fit` epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def fit_examples_per_sec(model, dataset, batch: int, steps: int, epochs: int) -> float:
    """A compiled model's `model.fit` rate over `epochs` timed epochs of `steps` steps; one more
    epoch before them is the warm-up (tracing). Median over the timed epochs."""
    timer = EpochTimer()
    model.fit(dataset, epochs=epochs + 1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    return steps * batch / statistics.median(timer.seconds[1:])


def run_peak_rss_bytes(command: list, cwd: str, timeout: float = 600) -> tuple:
    """Runs `command` to its end: (exit code, the process's peak resident memory in bytes, its
    output). Children of the process are not counted."""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    output = []
    for line in process.stdout:  # read as it comes: a full pipe would block the child
        output.append(line)
        if time.monotonic() > deadline:
            process.kill()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_maxrss * 1024, "".join(output)
