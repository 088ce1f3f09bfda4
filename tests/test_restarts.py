"""The local launcher heals the cluster (--max_restarts): a worker killed mid-run makes it stop the
others and start the cluster again, which resumes from the last checkpoint and ends like a run that
was never disturbed; its last line after a failure names the newest checkpoint and how to go on.
(A permanent failure is never retried: tests/test_multi_worker.py.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import (
    QUIET,
    TASKS_FAULTS,
    explain,
    exported_weights,
    run_cli,
    small_config,
    small_flags,
    tensorboard_scalars,
)

from engine.controller.trainer import train
from engine.distribute.launch import resume_line

ARGS = [
    "--strategy=multi_worker_mirrored",
    "--num_workers=2",
    *small_flags(train_steps=8, steps_per_loop=2, checkpoint_every=2, model="mlp", collective_timeout=30),
]


@pytest.mark.cluster
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_undisturbed(tmp_path):
    proc = run_cli(
        *ARGS,
        f"--task={TASKS_FAULTS}:KilledOnceTask",
        "--max_restarts=2",
        f"--model_dir={tmp_path / 'run'}",
        "--export",
        timeout=300,
    )
    assert proc.returncode == 0, explain(proc)
    assert "launcher: restart 1 of 2 after exit 137 (killed by a signal, a restart may help)" in proc.stdout, explain(
        proc
    )
    assert os.path.exists(tmp_path / "run" / "killed_once")
    assert dict(tensorboard_scalars(tmp_path / "run" / "train"))["restarts"][0][1] == 1.0
    # 2 workers train like one process (tests/test_multi_worker.py): the undisturbed reference.
    train(
        small_config(
            tmp_path / "undisturbed", model="mlp", train_steps=8, steps_per_loop=2, checkpoint_every=2, export=True
        ),
        **QUIET,
    )
    for a, b in zip(exported_weights(tmp_path / "run"), exported_weights(tmp_path / "undisturbed")):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.fast
def test_max_restarts_without_the_launcher_is_refused():
    proc = run_cli("--max_restarts=1", "--dataset=synthetic", timeout=60)
    assert proc.returncode == 2 and "needs --num_workers=N" in proc.stderr.strip().splitlines()[-1], explain(proc)


@pytest.mark.fast
def test_the_launchers_last_line_names_the_newest_checkpoint_and_what_to_do(tmp_path):
    args = ["--train_steps=8", f"--model_dir={tmp_path}"]
    assert resume_line(150, args) == (
        "launcher: exit 150 (peer_lost, a restart may help); no checkpoint was written yet: "
        "rerun the same command to start again"
    )
    (tmp_path / "checkpoints").mkdir()
    for name in ("ckpt-4.index", "ckpt-12.index", "ckpt-12.data-00000-of-00001", "ckpt-20_temp", "checkpoint"):
        (tmp_path / "checkpoints" / name).write_text("")
    line = resume_line(2, args)
    assert f"the newest checkpoint is {tmp_path / 'checkpoints' / 'ckpt-12'} " in line, line
    assert "fix the cause, then rerun the same command to resume" in line and f"--model_dir={tmp_path}" in line
    assert "rerun the same command to resume" in resume_line(152, args) and "fix" not in resume_line(152, args)
