"""--on_nonfinite=rollback: a bad step restores the last checkpoint, the data moves past the bad
batch, training goes on and ends with finite weights; after --max_rollbacks the run stops as with
stop; --loss_upper_bound turns a loss spike into a bad step; the rollback survives a resume."""

from __future__ import annotations

import io
import os
import re

import numpy as np
import pytest
from helpers import QUIET, TASKS_NONFINITE, checkpoint_state, explain, run_cli, small_config, tensorboard_scalars

from engine.controller.trainer import train
from engine.errors import NonFiniteLoss, UserError

ROLLBACK = dict(
    model="mlp", on_nonfinite="rollback", train_steps=12, steps_per_loop=2, checkpoint_every=4, eval_every=-1
)
# NanLossTask's loss is NaN while global_step == 5, whatever the batch: a retry fails again.
NAN_AT_5 = dict(ROLLBACK, task=f"{TASKS_NONFINITE}:NanLossTask")


def _one_bad_example(directory) -> dict:
    """Overrides for float images in an npz with ONE NaN example (a bad batch, seen once per epoch:
    16 steps of 64, more than the run's 12)."""
    rng = np.random.default_rng(3)
    x = rng.random((1024, 28, 28), dtype=np.float32)
    x[100] = np.nan
    y = rng.integers(0, 10, 1024)
    path = os.path.join(str(directory), "bad.npz")
    np.savez(path, x_train=x, y_train=y, x_test=x[200:300], y_test=y[200:300])
    return dict(ROLLBACK, dataset=f"npz:{path}")


def _rollback_line(text: str) -> re.Match:
    found = re.search(r"rollback 1 of 3: bad step (\d+); back to step (\d+) .*past batch (\d+)", text)
    assert found, text
    return found


@pytest.mark.parametrize("input_mode", ["distribute_dataset", "resident"])
def test_a_bad_batch_rolls_back_and_training_goes_on_past_it(tmp_path, input_mode):
    out = io.StringIO()
    result = train(small_config(tmp_path / "run", **_one_bad_example(tmp_path), input_mode=input_mode), out=out)
    assert result.final_step == 12, out.getvalue()
    bad, restored, batch = (int(g) for g in _rollback_line(out.getvalue()).groups())
    assert restored < bad <= restored + 4 and batch == bad - 1
    state = checkpoint_state(tmp_path / "run", ("model/", "optimizer/", "data_offset/", "rollbacks/"))
    assert all(np.all(np.isfinite(v)) for v in state.values())
    assert int(next(v for k, v in state.items() if k.startswith("data_offset/"))) == bad - restored
    assert dict(tensorboard_scalars(tmp_path / "run" / "train")["rollbacks"]) == {restored: 1.0}


def test_after_max_rollbacks_the_run_stops_as_with_stop(tmp_path):
    with pytest.raises(NonFiniteLoss, match=r"at step 6 .*; 0 rollbacks made"):
        train(small_config(tmp_path, **NAN_AT_5, max_rollbacks=0), **QUIET)


def test_a_step_that_stays_bad_uses_up_the_rollbacks(tmp_path):
    """NanLossTask is bad at global_step 5 whatever the batch: every retry fails, then the run stops."""
    out = io.StringIO()
    with pytest.raises(NonFiniteLoss, match="2 rollbacks made"):
        train(small_config(tmp_path, **NAN_AT_5, max_rollbacks=2), out=out)
    assert "rollback 2 of 2" in out.getvalue()


def test_a_loss_spike_counts_as_a_bad_step(tmp_path):
    with pytest.raises(NonFiniteLoss, match=r"loss above --loss_upper_bound=0.5, at step 1 "):
        train(small_config(tmp_path, model="mlp", loss_upper_bound=0.5, eval_every=-1), **QUIET)


@pytest.mark.fast
def test_a_loss_bound_with_skip_is_refused(tmp_path):
    with pytest.raises(UserError, match="--loss_upper_bound=0.5 with --on_nonfinite=skip"):
        train(small_config(tmp_path, model="mlp", loss_upper_bound=0.5, on_nonfinite="skip"), **QUIET)


def test_a_run_resumed_after_a_rollback_equals_one_that_was_not_interrupted(tmp_path):
    straight = small_config(tmp_path / "straight", **_one_bad_example(tmp_path))
    out = io.StringIO()
    train(straight, out=out)
    bad = int(_rollback_line(out.getvalue()).group(1))
    resumed = straight.replace(model_dir=str(tmp_path / "resumed"))
    train(resumed.replace(train_steps=min(bad + 2, 11)), **QUIET)  # rolls back, then stops soon after
    train(resumed, **QUIET)
    a = checkpoint_state(tmp_path / "straight", ("model/", "optimizer/", "data_offset/"))
    b = checkpoint_state(tmp_path / "resumed", ("model/", "optimizer/", "data_offset/"))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, err_msg=name)


def test_rollback_from_the_command_line_finishes_with_exit_0(tmp_path):
    dataset = _one_bad_example(tmp_path)["dataset"]
    proc = run_cli(
        f"--dataset={dataset}",
        "--global_batch=64",
        "--train_steps=12",
        "--steps_per_loop=2",
        "--checkpoint_every=4",
        "--seed=7",
        "--model=mlp",
        "--on_nonfinite=rollback",
        "--max_rollbacks=3",
        f"--model_dir={tmp_path / 'run'}",
        "--noexport",
    )
    assert proc.returncode == 0, explain(proc)
    assert "rollback 1 of 3" in proc.stdout, explain(proc)
