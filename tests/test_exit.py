"""A finished run's process ends promptly after its last line (issue 15, part 1).

What this guards against: with --strategy=mirrored, deleting the training iterator can wait for a
tf.data autotune thread to sleep out its period (see engine/data/pipelines.py). Whether that wait
happens is a race, so each layout runs three times.

The mirrored runs train long enough to show that wait: an autotune thread sleeps 10 ms, 20 ms,
... doubling, so it wakes about 5.1, 10.2 and 20.5 s after the first batch, and an iterator
deleted 11-17 s after it waits the 3-9 s to the next wake-up whenever the race is lost. So each
run after the first trains about TRAIN_SECONDS at the speed the one before it reported (the
first: 1500 steps, about that at 7k examples/s). The two-worker runs can be short: what would
keep them alive is one sleeping thread per timed collective, piling up with the steps (the count
is checked in test_multi_worker.py::test_long_multi_worker_run_keeps_its_thread_count).

The default run keeps the two-replica layout: it has every thread the one-replica layout has (the
input pipeline's, a per-device dataset's) and one more per-device dataset, so a regression either
would show also shows there. The one-replica layout is the slow lane's (`-m slow`).
"""

from __future__ import annotations

import re

import pytest

from helpers import run_cli_timed

RUN = [
    "--dataset=synthetic",
    "--synthetic_train_examples=2048",
    "--synthetic_test_examples=256",
    "--global_batch=64",
    "--summaries=basic",
    "--noexport",
    "--seed=3",
    "--collective_timeout=60",
]
RUNS = 3
MAX_SECONDS_AFTER_LAST_LINE = 3.0
TRAIN_SECONDS = 13.0  # see the docstring


def _steps(n: int) -> list:
    """n steps (a multiple of 3), evaluated and checkpointed only at the end, in 3 loops."""
    return [f"--train_steps={n}", f"--steps_per_loop={n // 3}", f"--eval_every={n}", f"--checkpoint_every={n}"]


def _steps_for(seconds: float, output: str, default: int) -> int:
    """About `seconds` of training at the examples/s the run that printed `output` reported."""
    speed = re.search(r"([\d,]+) train examples/s", output)
    if not speed:
        return default
    return max(300, min(6000, round(seconds * int(speed.group(1).replace(",", "")) / 64 / 3) * 3))


@pytest.mark.parametrize(
    "layout, steps",
    [
        pytest.param(["--strategy=mirrored", "--cpu_replicas=1"], 1500, marks=pytest.mark.slow),
        (["--strategy=mirrored", "--cpu_replicas=2"], 1500),
        pytest.param(["--strategy=multi_worker_mirrored", "--num_workers=2"], 60, marks=pytest.mark.cluster),
    ],
    ids=["mirrored_1_replica", "mirrored_2_replicas", "two_workers"],
)
def test_process_ends_promptly_after_its_last_line(tmp_path, layout, steps):
    lingered = []
    for run in range(RUNS):
        result = run_cli_timed(*layout, *_steps(steps), *RUN, f"--model_dir={tmp_path / str(run)}", timeout=180)
        assert result.returncode == 0, result.output[-3000:]
        assert "wall time" in result.output  # the summary was printed: the run finished
        seconds = result.seconds_after_last_line
        print(
            f"{layout} {steps} steps, run {run}: exited {seconds:.2f} s after its last line, "
            f"{result.exited:.1f} s in all"
        )
        if layout[0] == "--strategy=mirrored":
            steps = _steps_for(TRAIN_SECONDS, result.output, steps)
        if seconds > MAX_SECONDS_AFTER_LAST_LINE:
            lingered.append(f"run {run}: exited {seconds:.1f} s after its last line ({result.lines[-1][2].strip()!r})")
    assert not lingered, lingered
