"""Every resume-time change is named (issue 46 item 3, invariant 14).

A flag that differs from the run's record on resume is refused (the identity flags: test_run_record)
or named in the banner, one line each, and kept in the record's history with its step. Adding
--ema_decay or --on_nonfinite=rollback on resume works: the new state starts from the restored
checkpoint, said in one line; the exit-4 advice (--on_nonfinite=rollback) leads to a command that
finishes. Checkpoints without config.json are refused in one line.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import QUIET, TINY_FLAGS, explain, run_cli, small_config

from engine.controller.trainer import train
from engine.errors import UserError


def _run(config) -> str:
    out = io.StringIO()
    train(config, out=out)
    return out.getvalue()


def _changed_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("changed ")]


def _tensor(model_dir, step: int, key: str) -> np.ndarray:
    return tf.train.load_checkpoint(os.path.join(str(model_dir), "checkpoints", f"ckpt-{step}")).get_tensor(key)


def test_each_allowed_change_is_one_banner_line_and_kept_in_the_record(tmp_path):
    config = small_config(tmp_path, model="mlp", train_steps=2, steps_per_loop=2)
    train(config, **QUIET)
    changed = config.replace(train_steps=4, learning_rate=0.5, weight_decay=0.01, clip_norm=1.0, grad_accum_steps=2)
    lines = _changed_lines(_run(changed))
    assert sorted(lines) == sorted(
        [
            "changed      --learning_rate unset -> 0.5 at step 2",
            "changed      --weight_decay 0.0 -> 0.01 at step 2",
            "changed      --clip_norm 0.0 -> 1.0 at step 2",
            "changed      --grad_accum_steps 1 -> 2 at step 2",
            "changed      --train_steps 2 -> 4 at step 2",
        ]
    ), lines
    record = json.loads((tmp_path / "config.json").read_text())
    assert record["flags"]["learning_rate"] == 0.5  # the next resume compares with what this one ran
    assert {"step": 2, "flag": "learning_rate", "from": None, "to": 0.5} in record["changes"]
    assert len(record["changes"]) == 5

    again = _run(changed.replace(train_steps=6, learning_rate=0.001))
    assert _changed_lines(again) == [
        "changed      --learning_rate 0.5 -> 0.001 at step 4",
        "changed      --train_steps 4 -> 6 at step 4",
    ]
    history = json.loads((tmp_path / "config.json").read_text())["changes"]
    assert len(history) == 7 and history[-2] == {"step": 4, "flag": "learning_rate", "from": 0.5, "to": 0.001}


def test_adding_ema_on_resume_starts_the_averages_from_the_restored_weights(tmp_path):
    config = small_config(tmp_path, model="mlp", train_steps=2, steps_per_loop=1, eval_every=-1)
    train(config, **QUIET)
    text = _run(config.replace(train_steps=3, ema_decay=0.9))
    assert "changed      --ema_decay 0.0 -> 0.9 at step 2" in text, text
    assert "resume       --ema_decay=0.9: checkpoint ckpt-2 holds no weight averages; they start from its" in text
    # One update after the resume: average = d * (restored weight) + (1 - d) * (new weight), with
    # the warm-up's d = min(0.9, 1 / 10) (engine/ema.py); initial weights would give another value.
    assert int(_tensor(tmp_path, 3, "ema_updates/.ATTRIBUTES/VARIABLE_VALUE")) == 1
    for i in range(4):
        weight = f"optimizer/_trainable_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"
        average = _tensor(tmp_path, 3, f"ema/{i}/.ATTRIBUTES/VARIABLE_VALUE")
        expected = 0.1 * _tensor(tmp_path, 2, weight) + 0.9 * _tensor(tmp_path, 3, weight)
        np.testing.assert_allclose(average, expected, rtol=1e-5, atol=1e-6)
    # And dropped again: named, and the run resumes.
    dropped = _run(config.replace(train_steps=4))
    assert "changed      --ema_decay 0.9 -> 0.0 at step 3 (the checkpoint's weight averages are dropped)" in dropped


def test_checkpoints_without_a_record_are_refused_in_one_line(tmp_path):
    config = small_config(tmp_path, model="mlp", train_steps=2, steps_per_loop=2, eval_every=-1)
    train(config, **QUIET)
    os.remove(tmp_path / "config.json")
    with pytest.raises(UserError, match=r"holds checkpoints but no config.json .*--allow_config_change") as refused:
        train(config.replace(train_steps=4, global_batch=32), **QUIET)
    assert "\n" not in refused.value.message
    allowed = _run(config.replace(train_steps=4, allow_config_change=True))
    assert "changed      no config.json: this run's flags are recorded as the run's at step 2" in allowed
    assert json.loads((tmp_path / "config.json").read_text())["flags"]["train_steps"] == 4


def test_the_exit_4_advice_rollback_resumes_and_finishes(tmp_path):
    # One NaN example: the step whose batch holds it is bad (16 batches an epoch, the run is 16 steps).
    rng = np.random.default_rng(3)
    x = rng.random((1024, 28, 28), dtype=np.float32)
    x[100] = np.nan
    y = rng.integers(0, 10, 1024)
    np.savez(tmp_path / "bad.npz", x_train=x, y_train=y, x_test=x[:100], y_test=y[:100])
    flags = [
        *(f for f in TINY_FLAGS if not f.startswith("--dataset") and not f.startswith("--synthetic")),
        f"--dataset=npz:{tmp_path / 'bad.npz'}",
        "--train_steps=16",
        "--checkpoint_every=4",
        "--eval_every=-1",
        "--noexport",
        f"--model_dir={tmp_path / 'run'}",
    ]
    stopped = run_cli(*flags)
    assert stopped.returncode == 4, explain(stopped)
    assert "--on_nonfinite=skip or rollback" in stopped.stderr.strip().splitlines()[-1], explain(stopped)
    resumed = run_cli(*flags, "--on_nonfinite=rollback")
    assert resumed.returncode == 0, explain(resumed)
    assert "changed      --on_nonfinite stop -> rollback" in resumed.stdout, explain(resumed)
    assert "holds no rollback counters; they start at 0" in resumed.stdout, explain(resumed)
    assert "rollback 1 of 3" in resumed.stdout and "steps 0 -> 16" not in resumed.stdout, explain(resumed)
    # Dropping rollback now would lose the data position its counters hold: refused, naming the flag.
    dropped = small_config(tmp_path / "run", dataset=f"npz:{tmp_path / 'bad.npz'}", model="mlp", seed=1)
    with pytest.raises(UserError, match=r"^--on_nonfinite=stop: checkpoint .*resume with --on_nonfinite=rollback"):
        train(
            dropped.replace(synthetic_train_examples=512, steps_per_loop=2, train_steps=18, checkpoint_every=4), **QUIET
        )
