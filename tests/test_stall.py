"""--stall_timeout: a worker whose steps stop (a blocked input pipeline, a frozen peer) ends by
itself with the stalled code (151), one line naming who stopped, and a stack dump in model_dir."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from helpers import REPO, TASKS_FAULTS, explain, finish_all, run_cli, small_flags

from engine import exit_codes
from engine.distribute.launch import worker_tf_configs

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
    processes = []
    for tf_config in worker_tf_configs(2):
        env = dict(os.environ, TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="3")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(REPO, "run.py"),
                    "--strategy=multi_worker_mirrored",
                    *ARGS,
                    f"--task={TASKS_FAULTS}:{task}",
                    "--collective_timeout=30",
                    f"--model_dir={tmp_path}",
                    "--noexport",
                    *extra,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return processes


def test_a_worker_whose_input_blocks_is_named_and_every_worker_exits(tmp_path):
    started = time.monotonic()
    processes = _workers(tmp_path, "BlockingInputOnWorkerOneTask", ["--stall_timeout=10"])
    codes, outputs = finish_all(processes, timeout=150)
    assert all(code >= 128 for code in codes), (codes, outputs)
    assert time.monotonic() - started < 150
    last = outputs[0].strip().splitlines()[-1]
    assert "worker 1 (waits for its input" in last, outputs[0][-3000:]
    assert codes[0] == exit_codes.STALLED.code, outputs[0][-3000:]
    assert all("Traceback" not in output for output in outputs), outputs
    dumps = [d for d in _stack_dumps(tmp_path) if "worker-1-" in d]
    assert dumps and "wait_for_the_filesystem" in open(dumps[0]).read()


def test_a_frozen_worker_is_named(tmp_path):
    processes = _workers(tmp_path, "SlowTrainingTask", ["--stall_timeout=15", "--train_steps=400"])
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(tmp_path, "checkpoints")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        processes[1].send_signal(signal.SIGSTOP)
        output = processes[0].communicate(timeout=120)[0]
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)
            process.kill()
    assert processes[0].returncode >= 128, output[-3000:]
    assert "worker 1" in output.strip().splitlines()[-1] or "worker:1" in output.strip().splitlines()[-1], output[
        -3000:
    ]
