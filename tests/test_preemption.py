"""Preemption: SIGTERM/SIGINT finish the compiled loop in flight, save a checkpoint and exit 3;
rerunning the same command resumes and ends with the weights of a run never interrupted."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, exported_weights, small_config
from engine.errors import Preempted
from engine.trainer import train
from test_resume import checkpoint_state


class SignalOnFirstProgress(io.StringIO):
    """An output stream that sends this process `signum` when the first progress line is written."""

    def __init__(self, signum):
        super().__init__()
        self.signum, self.sent = signum, False

    def write(self, text):
        if not self.sent and text.startswith("epoch"):
            self.sent = True
            os.kill(os.getpid(), self.signum)
        return super().write(text)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_at_the_loop_boundary_and_restores_handlers(tmp_path, signum):
    previous = signal.getsignal(signum)
    config = small_config(tmp_path / "stopped", strategy="mirrored", cpu_replicas=2, train_steps=12)
    out = SignalOnFirstProgress(signum)
    with pytest.raises(Preempted, match=f"{signal.Signals(signum).name} at step 3: checkpoint .*ckpt-3"):
        train(config, out=out)
    assert signal.getsignal(signum) is previous  # train() put the caller's handler back
    assert int(checkpoint_state(tmp_path / "stopped")["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == 3
    resumed = train(config, out=io.StringIO())
    assert resumed.start_step == 3 and resumed.final_step == 12
    train(config.replace(model_dir=str(tmp_path / "straight")), out=io.StringIO())
    stopped, straight = checkpoint_state(tmp_path / "stopped"), checkpoint_state(tmp_path / "straight")
    for name in straight:
        np.testing.assert_allclose(stopped[name], straight[name], rtol=1e-5, atol=1e-6, err_msg=name)


CLI = ["--dataset=synthetic", "--synthetic_train_examples=512", "--synthetic_test_examples=100",
       "--global_batch=64", "--model=mlp", "--steps_per_loop=5", "--train_steps=2000",
       "--eval_every=2000", "--checkpoint_every=2000", "--seed=3", "--deterministic"]


def _start(model_dir):
    return subprocess.Popen(
        [sys.executable, os.path.join(REPO, "run.py"), *CLI, f"--model_dir={model_dir}"], cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def _finish(proc, timeout=180):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()


def test_sigterm_on_run_py_exits_3_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path):
    model_dir = tmp_path / "stopped"
    proc = _start(model_dir)
    first_progress = threading.Event()
    stdout_lines = []

    def read_stdout():
        for line in proc.stdout:
            stdout_lines.append(line)
            if line.startswith("epoch"):
                first_progress.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    assert first_progress.wait(timeout=120), "no progress line: " + "".join(stdout_lines)
    proc.send_signal(signal.SIGTERM)
    _, stderr = _finish(proc, timeout=60)
    reader.join(timeout=10)
    assert proc.returncode == 3, stderr[-3000:]
    assert "Traceback" not in stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("preempted: SIGTERM at step ") and "rerun the same command" in last, stderr[-3000:]
    stopped_at = int(last.split("at step ")[1].split(":")[0])
    assert 0 < stopped_at < 2000 and stopped_at % 5 == 0  # a loop boundary
    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert latest.endswith(f"ckpt-{stopped_at}") and latest in last

    resumed_out, resumed_err = _finish(_start(model_dir))
    assert f"resuming at step {stopped_at}" in resumed_out, resumed_err[-3000:]
    straight_out, straight_err = _finish(_start(tmp_path / "straight"))
    assert "steps 0 -> 2000" in straight_out, straight_err[-3000:]
    resumed, straight = exported_weights(model_dir), exported_weights(tmp_path / "straight")
    assert all(np.array_equal(a, b) for a, b in zip(resumed, straight))  # bitwise: one replica, deterministic
