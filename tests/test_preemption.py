"""Preemption: SIGTERM/SIGINT finish the compiled loop in flight, save a checkpoint and exit 138;
rerunning the same command resumes and ends with the weights of a run never interrupted."""

from __future__ import annotations

import io
import os
import signal

import numpy as np
import pytest
import tensorflow as tf

from helpers import checkpoint_state, exported_weights, run_cli, small_config, start_cli, start_workers
from engine import exit_codes
from engine.errors import Preempted
from engine.controller.trainer import train


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


CLI = [
    "--dataset=synthetic",
    "--synthetic_train_examples=512",
    "--synthetic_test_examples=100",
    "--global_batch=64",
    "--model=mlp",
    "--steps_per_loop=5",
    "--train_steps=2000",
    "--eval_every=2000",
    "--checkpoint_every=2000",
    "--seed=3",
    "--deterministic",
]


def test_sigterm_on_run_py_exits_3_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path):
    model_dir = tmp_path / "stopped"
    with start_cli(*CLI, f"--model_dir={model_dir}", merge_stderr=False) as proc:
        proc.wait_for_line(r"^epoch", timeout=120)  # the first progress line
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    stderr = proc.stderr
    assert proc.returncode == exit_codes.PREEMPTED.code, stderr[-3000:]
    assert "Traceback" not in stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("preempted: SIGTERM at step ") and "rerun the same command" in last, stderr[-3000:]
    stopped_at = int(last.split("at step ")[1].split(":")[0])
    assert 0 < stopped_at < 2000 and stopped_at % 5 == 0  # a loop boundary
    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    assert latest.endswith(f"ckpt-{stopped_at}") and latest in last

    resumed = run_cli(*CLI, f"--model_dir={model_dir}", timeout=180)
    assert f"resuming at step {stopped_at}" in resumed.stdout, resumed.stderr[-3000:]
    straight = run_cli(*CLI, f"--model_dir={tmp_path / 'straight'}", timeout=180)
    assert "steps 0 -> 2000" in straight.stdout, straight.stderr[-3000:]
    resumed, straight = exported_weights(model_dir), exported_weights(tmp_path / "straight")
    assert all(np.array_equal(a, b) for a, b in zip(resumed, straight))  # bitwise: one replica, deterministic


@pytest.mark.cluster
def test_sigterm_to_the_launcher_stops_every_worker_at_one_step_and_resumes(tmp_path):
    """The launcher forwards SIGTERM; both workers agree (all-reduced flag) on the step to stop at."""
    args = [
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--collective_timeout=30",
        *CLI,
        "--train_steps=300",
        f"--model_dir={tmp_path}",
    ]
    with start_cli(*args) as launcher:
        launcher.wait_for_line(r"^\[worker 0\] epoch", timeout=180)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    output = launcher.output
    assert launcher.returncode == exit_codes.PREEMPTED.code, output[-3000:]
    lines = output.splitlines()
    stops = sorted({line.split(" at step ")[1].split(":")[0] for line in lines if "preempted: SIGTERM at step" in line})
    assert len(stops) == 1, output[-3000:]  # both workers stopped at the same step
    chief_checkpoint = os.path.join(str(tmp_path), "checkpoints", f"ckpt-{stops[0]}")
    for worker in (0, 1):  # the non-chief too names the chief's checkpoint (it saved into a temporary one)
        preempted = next(line for line in lines if line.startswith(f"[worker {worker}] preempted: "))
        assert f"checkpoint {chief_checkpoint};" in preempted, preempted
    rerun = run_cli(*args, timeout=240)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"(resuming at step {stops[0]})" in rerun.stdout


@pytest.mark.cluster
def test_sigterm_to_one_worker_of_a_cluster_stops_every_worker_at_one_step(tmp_path):
    """A cluster manager preempts ONE pod: every worker checkpoints the same step and exits 138."""
    with start_workers(["--collective_timeout=30", *CLI, "--train_steps=300", f"--model_dir={tmp_path}"]) as cluster:
        cluster.wait_for_line(0, r"^epoch", timeout=180)  # worker 0's first progress line
        cluster[1].send_signal(signal.SIGTERM)
        cluster[0].wait(timeout=120)
        cluster[1].wait(timeout=60)
    outputs = cluster.outputs
    assert cluster.codes == [exit_codes.PREEMPTED.code] * 2, outputs
    stops = {
        line.split(" at step ")[1].split(":")[0]
        for output in outputs
        for line in output.splitlines()
        if "preempted: " in line and " at step " in line
    }
    assert len(stops) == 1, outputs
    assert int(checkpoint_state(tmp_path)["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == int(stops.pop())


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_usable(tmp_path):
    """What a kill -9 in the middle of a save leaves behind (data written, no index, the state file
    not yet updated): the next run restores the previous checkpoint. TensorFlow writes into a
    temporary name and updates the `checkpoint` state file last, which this relies on."""
    config = small_config(tmp_path, train_steps=4, steps_per_loop=2, checkpoint_every=2)
    train(config, out=io.StringIO())
    directory = tmp_path / "checkpoints"
    (directory / "ckpt-6_temp").mkdir()
    (directory / "ckpt-6_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 1000)
    (directory / "ckpt-6.data-00000-of-00001").write_bytes(b"half written")
    resumed = train(config.replace(train_steps=6), out=io.StringIO())
    assert resumed.start_step == 4 and resumed.final_step == 6
