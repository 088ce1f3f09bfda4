"""The local launcher heals the cluster (--max_restarts): a worker killed mid-run makes it stop the
others and start the cluster again, which resumes from the last checkpoint and ends like a run that
was never disturbed. (A permanent failure is never retried: tests/test_multi_worker.py.)"""

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
