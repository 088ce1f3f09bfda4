"""How steady is this machine? The same compiled matmul loop timed again and again.

    python -m benchmarks.drift                 # 150 s
    python -m benchmarks.drift --seconds=60

Times a fixed loop of 512x512 float32 matmuls (well under the half second) every half second and
prints the spread of the timings and of each timing against the one before it. The other
benchmarks pair measurements taken seconds to minutes apart: where the machine's own speed drifts
by 10 %, a ratio of 1.0 cannot be told from 0.95 or 1.05 in one pairing, however good the code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from benchmarks import measure  # noqa: E402


def drift(seconds: float, pause: float = 0.5, matmuls: int = 200) -> list:
    """Seconds per timing of the same loop of `matmuls` matmuls, one timing every `pause` s."""
    matrix = tf.Variable(tf.random.stateless_normal([512, 512], seed=[1, 2]))  # a variable: never constant-folded
    time_once = measure.call_timer(lambda: tf.reduce_mean(matrix @ matrix), matmuls)
    timings, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        timings.append(time_once() * matmuls)
        time.sleep(pause)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long to watch (s)")
    args = parser.parse_args()
    timings = drift(args.seconds)
    median = statistics.median(timings)
    changes = [b / a for a, b in zip(timings, timings[1:])]
    print(f"{len(timings)} timings of the same matmul loop over {args.seconds:.0f} s on {measure.device_description()}")
    print(
        f"  each / median: lowest {min(timings) / median:.2f}, highest {max(timings) / median:.2f}; "
        f"10th-90th percentile {_percentile(timings, 10) / median:.2f}-{_percentile(timings, 90) / median:.2f}"
    )
    print(
        f"  each / the one before: 10th-90th percentile {_percentile(changes, 10):.2f}-{_percentile(changes, 90):.2f}"
    )
    thirds = [
        statistics.median(timings[i * len(timings) // 3 : (i + 1) * len(timings) // 3]) / median for i in range(3)
    ]
    print("  median of each third / median: " + ", ".join(f"{t:.2f}" for t in thirds))


def _percentile(values, percent: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(percent / 100 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
