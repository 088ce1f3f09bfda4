"""The worked example of a changed step (engine/tasks/label_smoothing.py, --task=label_smoothing)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import QUIET, TASKS_EQUIVALENCE, exported_weights, small_config, tensorboard_scalars

from engine.controller.trainer import train
from engine.tasks.label_smoothing import LabelSmoothingTask

TWO_REPLICAS = dict(strategy="mirrored", cpu_replicas=2)


@pytest.mark.fast
def test_smoothed_loss_is_the_cross_entropy_against_smoothed_labels():
    task = LabelSmoothingTask(small_config("/unused"), input_shape=(28, 28, 1), num_classes=4)
    logits = np.array([[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    labels = np.array([0, 3])
    targets = np.full((2, 4), 0.1 / 4) + 0.9 * np.eye(4)[labels]
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(
        task.per_example_loss(labels, logits).numpy(), -(targets * log_softmax).sum(axis=1), rtol=1e-6
    )


def test_two_replicas_train_like_one(tmp_path):
    """The regulariser is added through replica_loss (divided by the replica count), so 2 replicas
    match 1; adding it undivided on each replica would count it twice."""
    task = f"{TASKS_EQUIVALENCE}:QuietLabelSmoothingTask"
    two = small_config(tmp_path / "two", task=task, export=True, **TWO_REPLICAS)
    train(two, **QUIET)
    train(two.replace(model_dir=str(tmp_path / "one"), strategy="default", cpu_replicas=1), **QUIET)
    for a, b in zip(exported_weights(tmp_path / "two"), exported_weights(tmp_path / "one")):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_registered_name_trains_on_two_replicas_and_logs_its_metric(tmp_path):
    result = train(
        small_config(
            tmp_path, task="label_smoothing", model="mlp", export=True, train_steps=12, steps_per_loop=6, **TWO_REPLICAS
        ),
        **QUIET,
    )
    assert result.eval_metrics["loss"] < 2.3 and set(result.train_metrics) >= {"loss", "accuracy", "penalty"}
    penalties = dict(tensorboard_scalars(tmp_path / "train")["penalty"])
    kernel = exported_weights(tmp_path)[-2]  # the output layer's kernel after the last update
    # Logged: the mean over the loop's steps of the penalty before each update (weights move little).
    np.testing.assert_allclose(penalties[12], LabelSmoothingTask.PENALTY * np.square(kernel).sum(), rtol=0.05)
