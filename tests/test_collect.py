"""Whole-eval-set metrics (Task.collect in eval_step, Task.eval_summary on the host): every eval
example's rows exactly once in the eval set's order (a partial last batch split unevenly over the
replicas included), macro-F1 and one-vs-rest AUC (examples/auc_f1.py) equal to scikit-learn's on
the same predictions on 1, 2 and 3 replicas, in training and --mode=eval, the summary's scalar as
--best_metric, and the misuses refused in one line."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from helpers import QUIET, TASKS_COLLECT, explain, run_cli, small_config, small_flags, tensorboard_scalars
from sklearn.metrics import f1_score, roc_auc_score

from engine.controller.evaluator import evaluate
from engine.controller.trainer import train
from engine.data.builtin import synthetic_arrays
from engine.errors import UserError

RECORDING = f"{TASKS_COLLECT}:RecordingAucF1Task"
# 301 test examples at a global batch of 48: 6 whole batches and a partial one of 13, which 2 and
# 3 replicas split unevenly (7 + 6; 5 + 4 + 4).
TEST_EXAMPLES, BATCH = 301, 48
RUN = dict(task=RECORDING, model="mlp", synthetic_test_examples=TEST_EXAMPLES, global_batch=BATCH, train_steps=4)


def _recorded(model_dir) -> dict:
    (path,) = glob.glob(os.path.join(str(model_dir), "collected-*.npz"))
    with np.load(path) as recorded:
        return dict(recorded)


def _check_against_sklearn(recorded, metrics=None) -> None:
    """The collected rows are the eval set's, in order; the summary is scikit-learn's on them."""
    _, expected_labels = synthetic_arrays(TEST_EXAMPLES, seed=2)  # the synthetic source's test split
    labels, probabilities = recorded["labels"], recorded["probabilities"]
    assert probabilities.shape == (TEST_EXAMPLES, 10)
    np.testing.assert_array_equal(labels, expected_labels)
    f1 = f1_score(labels, np.argmax(probabilities, axis=1), average="macro", labels=range(10), zero_division=0)
    auc = roc_auc_score(labels, probabilities / probabilities.sum(1, keepdims=True), multi_class="ovr")
    for name, value in (("macro_f1", f1), ("macro_auc", auc)):
        assert abs(float(recorded[f"summary_{name}"]) - value) <= 1e-6, (name, recorded[f"summary_{name}"], value)
        if metrics is not None:
            assert abs(metrics[name] - value) <= 1e-6


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    run = tmp_path_factory.mktemp("collect") / "r1"
    result = train(small_config(run, **RUN), **QUIET)
    return run, result


@pytest.mark.fast
def test_eval_summary_equals_sklearn_on_one_replica_with_a_partial_last_batch(one_replica):
    run, result = one_replica
    _check_against_sklearn(_recorded(run), result.eval_metrics)
    scalars = tensorboard_scalars(os.path.join(str(run), "eval"))
    assert scalars["macro_auc"][-1][1] == pytest.approx(result.eval_metrics["macro_auc"], abs=1e-6)


def test_two_replicas_in_training_and_mode_eval_give_the_same(one_replica, tmp_path):
    run, trained = one_replica
    two = tmp_path / "r2"
    result = train(small_config(two, strategy="mirrored", cpu_replicas=2, **RUN), **QUIET)
    _check_against_sklearn(_recorded(two), result.eval_metrics)
    # the 1-replica run's last checkpoint evaluated on 2 replicas: its training metrics again
    for path in glob.glob(os.path.join(str(run), "collected-*.npz")):
        os.remove(path)
    evaluated = evaluate(small_config(run, mode="eval", strategy="mirrored", cpu_replicas=2, **RUN), out=QUIET["out"])
    (metrics,) = evaluated.evaluated.values()
    _check_against_sklearn(_recorded(run), metrics)
    for name in ("macro_f1", "macro_auc", "loss", "accuracy"):
        assert metrics[name] == pytest.approx(trained.eval_metrics[name], abs=1e-6), name


def test_three_replicas_with_the_summary_as_best_metric(tmp_path):
    """A fresh process with 3 CPU replicas: trains, keeps best/ by eval_summary's macro_auc."""
    run = tmp_path / "r3"
    flags = small_flags(**{**RUN, "strategy": "mirrored", "cpu_replicas": 3}, best_metric="+macro_auc")
    proc = run_cli(*flags, "--noexport", f"--model_dir={run}", timeout=240)
    assert proc.returncode == 0, explain(proc)
    recorded = _recorded(run)
    _check_against_sklearn(recorded)
    assert "macro_auc" in proc.stdout and "macro_f1" in proc.stdout
    with open(run / "best" / "best.json") as f:
        best = json.load(f)
    assert best["metric"] == "macro_auc" and best["higher_is_better"]
    assert best["value"] == pytest.approx(float(recorded["summary_macro_auc"]), abs=1e-6)


@pytest.mark.parametrize(
    "task, expected",
    [
        ("VectorTotalTask", "train_step returned a total or count of shape (10,) for 'per_class'"),
        ("TrainCollectTask", "self.collect('labels', ...) is only valid inside the engine's eval_step"),
    ],
)
def test_misuse_is_refused_in_one_line(tmp_path, task, expected):
    with pytest.raises(UserError) as refused:
        train(small_config(tmp_path / task, task=f"{TASKS_COLLECT}:{task}", model="mlp", train_steps=2), **QUIET)
    assert expected in refused.value.message and "\n" not in refused.value.message


def test_an_undeclared_best_metric_is_refused_at_start_up(tmp_path):
    with pytest.raises(UserError, match="there is no 'auc'.*eval_summary_metrics"):
        train(small_config(tmp_path / "run", **RUN, best_metric="+auc"), **QUIET)


def test_a_collection_too_large_for_the_host_is_refused_in_one_line():
    from engine.controller.evaluation import available_host_memory, check_collection_fits

    one_batch = {"probabilities": np.zeros((64, 10), np.float32), "labels": np.zeros(64, np.int32)}  # 44 B each
    check_collection_fits(one_batch, 64, 10_000, available_bytes=2 * 44 * 10_000)  # fits exactly
    with pytest.raises(UserError, match=r"collects 44 bytes per example \(probabilities \(10,\) float32, labels"):
        check_collection_fits(one_batch, 64, 10_000, available_bytes=2 * 44 * 10_000 - 1)
    assert available_host_memory() > 2**20  # the real probe the preflight passes in reads this machine
