"""--stall_timeout: a worker whose steps stop (a blocked input pipeline, a frozen peer) ends by
itself with the stalled code (151), one line naming who stopped, and a stack dump in model_dir."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from helpers import TASKS_FAULTS, explain, run_cli, small_flags, start_workers

from engine import exit_codes

ARGS = small_flags(train_steps=16, steps_per_loop=2, model="mlp")


def _stack_dumps(model_dir) -> list:
    return sorted(glob.glob(os.path.join(str(model_dir), "stalls", "*.txt")))


def test_a_blocked_input_pipeline_ends_the_run_as_stalled(tmp_path):
    started = time.monotonic()
    proc = run_cli(
        *ARGS,
        f"--task={TASKS_FAULTS}:BlockingInputTask",
        "--stall_timeout=4",
        f"--model_dir={tmp_path}",
        "--noexport",
        timeout=120,
    )
    assert proc.returncode == exit_codes.STALLED.code, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stalled: no training step completed for 4 s") and "waits for its input" in last
    assert "Traceback" not in proc.stderr
    (dump,) = _stack_dumps(tmp_path)
    assert "wait_for_the_filesystem" in open(dump).read()  # the frame where it waits
    assert time.monotonic() - started < 90


def _workers(tmp_path, task, extra=()):
    return start_workers(
        [
            *ARGS,
            f"--task={TASKS_FAULTS}:{task}",
            "--collective_timeout=30",
            f"--model_dir={tmp_path}",
            "--noexport",
            *extra,
        ]
    )


@pytest.mark.cluster
def test_a_worker_whose_input_blocks_is_named_and_every_worker_exits(tmp_path):
    started = time.monotonic()
    with _workers(tmp_path, "BlockingInputOnWorkerOneTask", ["--stall_timeout=10"]) as cluster:
        codes, outputs = cluster.wait(timeout=150), cluster.outputs
    assert all(code >= 128 for code in codes), (codes, outputs)
    assert time.monotonic() - started < 150
    last = outputs[0].strip().splitlines()[-1]
    assert "worker 1 (waits for its input" in last, outputs[0][-3000:]
    assert codes[0] == exit_codes.STALLED.code, outputs[0][-3000:]
    assert all("Traceback" not in output for output in outputs), outputs
    dumps = [d for d in _stack_dumps(tmp_path) if "worker-1-" in d]
    assert dumps and "wait_for_the_filesystem" in open(dumps[0]).read()


@pytest.mark.cluster
def test_a_frozen_worker_is_named(tmp_path):
    with _workers(tmp_path, "SlowTrainingTask", ["--stall_timeout=15", "--train_steps=400"]) as cluster:
        cluster.wait_until(lambda: os.path.exists(os.path.join(tmp_path, "checkpoints")), timeout=120)
        time.sleep(2)
        cluster[1].send_signal(signal.SIGSTOP)  # frozen: alive, but it runs nothing
        cluster[0].wait(timeout=120)
    output = cluster[0].output  # the kill at the block's end ends the stopped worker too
    assert cluster[0].returncode >= 128, output[-3000:]
    assert "worker 1" in output.strip().splitlines()[-1] or "worker:1" in output.strip().splitlines()[-1], output[
        -3000:
    ]
