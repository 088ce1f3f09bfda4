"""Ray Train (engine/distribute/ray_job.py) on a local Ray cluster that each job starts for itself
(`--ray_address=local`: ray.init starts one on this machine and ray.shutdown stops it when the
job ends): 2 Ray workers train like one replica fed the same global batch, bitwise like the
engine's own 2-worker launcher; a worker killed with SIGKILL mid-run is restarted by Ray's
failure policy and the run ends bitwise equal to the undisturbed one, with the restart count
logged; a permanent exit (2, a refused flag) is not retried and ends the job with 2. Each job
imports TensorFlow in the driver, Ray's controller and both workers, so each costs a minute or
two on 2 cores."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import (
    REPO,
    TASKS_FAULTS,
    explain,
    exported_by_name,
    run_cli,
    small_flags,
    tensorboard_scalars,
    trained_by_name,
)
from engine import exit_codes

pytestmark = pytest.mark.cluster

RUN = dict(  # SMALL_RUN's synthetic data, batch and seed, with an mlp and a checkpoint every loop
    synthetic_train_examples=512,
    synthetic_test_examples=128,
    model="mlp",
    train_steps=8,
    steps_per_loop=2,
    checkpoint_every=2,
)
FLAGS = [*small_flags(**RUN), "--collective_timeout=60", "--export"]


def _ray_job(model_dir, *flags, max_restarts=0, timeout=400):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "RAY_ADDRESS")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, "-m", "engine.distribute.ray_job", "--ray_workers=2", "--ray_address=local"]
    command += [f"--max_restarts={max_restarts}", "--", *FLAGS, *flags, f"--model_dir={model_dir}"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("undisturbed")
    code, output = _ray_job(model_dir)
    assert code == 0, output[-4000:]
    return output, exported_by_name(model_dir)


@pytest.mark.timeout(600)
def test_two_ray_workers_train_like_one_replica(undisturbed, tmp_path):
    output, weights = undisturbed
    assert "cluster      task worker:0 (chief) of 2 workers" in output, output[-4000:]
    assert "agreement    all 2 workers run the same flags" in output
    assert "ray_job: worker 1 runs run.py (restart 0)" in output and "(restart 1)" not in output
    one_replica = trained_by_name(tmp_path / "one", **RUN)
    assert weights.keys() == one_replica.keys()
    for name in weights:
        np.testing.assert_allclose(weights[name], one_replica[name], rtol=0, atol=1e-6, err_msg=name)
    # The same job on the engine's own launcher (2 local workers): bitwise the Ray job's result.
    launched = tmp_path / "launcher"
    proc = run_cli(
        *FLAGS, "--strategy=multi_worker_mirrored", "--num_workers=2", f"--model_dir={launched}", timeout=400
    )
    assert proc.returncode == 0, explain(proc)
    by_launcher = exported_by_name(launched)
    assert by_launcher.keys() == weights.keys()
    assert all(np.array_equal(weights[n], by_launcher[n]) for n in weights)  # bitwise


@pytest.mark.timeout(600)
def test_a_killed_worker_is_restarted_by_ray_and_resumes_exactly(undisturbed, tmp_path):
    model_dir = tmp_path / "run"
    code, output = _ray_job(model_dir, f"--task={TASKS_FAULTS}:KilledOnceTask", max_restarts=1)
    assert code == 0, output[-4000:]
    assert os.path.exists(model_dir / "killed_once")  # worker 1's run.py did die with SIGKILL
    assert "the group's first failure was exit 137" in output, output[-4000:]
    assert "ray_job: worker 1 runs run.py (restart 1)" in output
    assert "(resuming at step 4)" in output
    assert dict(tensorboard_scalars(model_dir / "train"))["restarts"][0][1] == 1.0
    resumed, straight = exported_by_name(model_dir), undisturbed[1]
    assert resumed.keys() == straight.keys()
    assert all(np.array_equal(resumed[n], straight[n]) for n in straight)  # bitwise


@pytest.mark.timeout(400)
def test_a_permanent_exit_is_not_retried_and_ends_the_job_with_its_code(tmp_path):
    code, output = _ray_job(tmp_path / "run", "--evaluator", max_restarts=2)  # refused: exit 2 on each worker
    assert code == exit_codes.BAD_INPUT.code, output[-4000:]
    assert "error: --evaluator needs --strategy=multi_worker_mirrored --num_workers=N" in output
    assert "(restart 1)" not in output and "ray_job: exit 2 (bad_input" in output
