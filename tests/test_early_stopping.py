"""--early_stopping_patience: training ends cleanly (exit 0, final checkpoint, one line naming the
step and the best value) when --best_metric stops improving; a resumed run remembers its count; on
two workers every worker stops at the same step."""

from __future__ import annotations

import io
import json
import os

import pytest
import tensorflow as tf
from helpers import QUIET, explain, run_cli, small_config

from engine.controller.trainer import train
from engine.errors import UserError

# A learning rate too small to change the loss: no evaluation improves on the first.
FROZEN = dict(
    model="mlp",
    learning_rate=1e-12,
    eval_every=2,
    steps_per_loop=2,
    train_steps=20,
    best_metric="loss",
    early_stopping_patience=2,
)


def _record(model_dir) -> dict:
    with open(os.path.join(str(model_dir), "early_stopping.json")) as f:
        return json.load(f)


def test_a_metric_that_stops_improving_ends_training_cleanly(tmp_path):
    out = io.StringIO()
    result = train(small_config(tmp_path, **FROZEN), out=out)
    assert result.final_step == 6, out.getvalue()  # evaluations at 2 (best), 4 (1 without), 6 (2: stop)
    assert "early stopping at step 6" in result.stopped_early and "best " in result.stopped_early
    assert "early stopping at step 6" in out.getvalue()
    assert tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints")).endswith("ckpt-6")
    assert _record(tmp_path)["stopped_at"] == 6


def test_an_improving_metric_trains_to_the_end(tmp_path):
    result = train(
        small_config(
            tmp_path, **{**FROZEN, "learning_rate": 1e-3, "best_metric": "loss", "early_stopping_patience": 5}
        ),
        **QUIET,
    )
    assert result.final_step == 20 and result.stopped_early is None


def test_a_resumed_run_remembers_its_count(tmp_path):
    patient = dict(FROZEN, early_stopping_patience=3)
    train(small_config(tmp_path, **{**patient, "train_steps": 4}), **QUIET)  # evaluations at 2 and 4: 1 without
    result = train(small_config(tmp_path, **patient), **QUIET)
    assert result.final_step == 8  # 6: 2 without, 8: 3 without (a fresh count would stop at 10)


def test_early_stopping_without_a_metric_is_refused(tmp_path):
    with pytest.raises(UserError, match="needs --best_metric"):
        train(small_config(tmp_path, **{**FROZEN, "best_metric": ""}), **QUIET)


@pytest.mark.cluster
def test_every_worker_stops_at_the_same_step(tmp_path):
    proc = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--dataset=synthetic",
        "--synthetic_train_examples=1024",
        "--synthetic_test_examples=300",
        "--global_batch=64",
        "--seed=7",
        "--model=mlp",
        "--collective_timeout=30",
        "--learning_rate=1e-12",
        "--eval_every=2",
        "--steps_per_loop=2",
        "--train_steps=20",
        "--best_metric=loss",
        "--early_stopping_patience=2",
        f"--model_dir={tmp_path}",
        "--noexport",
        timeout=180,
    )
    # Had worker 1 gone on training alone, its next collective would wait for a peer that left (exit 2).
    assert proc.returncode == 0, explain(proc)
    assert "[worker 0] early stopping at step 6" in proc.stdout, explain(proc)
    assert tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints")).endswith("ckpt-6")
