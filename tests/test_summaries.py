"""TensorBoard logs, read back with the tensorboard package's own reader."""

from __future__ import annotations

import os

from tensorboard.backend.event_processing import event_accumulator

from conftest import small_config
from engine.summaries import create_writers
from engine.trainer import train


def _scalars(logdir):
    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    # tf.summary.scalar in TF 2 writes tensor events; EventAccumulator lists them under "tensors".
    return {tag: [e.step for e in accumulator.Tensors(tag)] for tag in accumulator.Tags()["tensors"]}


def test_train_and_eval_scalars_at_global_steps(tmp_path):
    train(small_config(tmp_path, strategy="mirrored", cpu_replicas=2, train_steps=7, steps_per_loop=3,
                       eval_every=4), out=open(os.devnull, "w"))
    train_tags = _scalars(tmp_path / "train")
    for tag in ("loss", "accuracy", "learning_rate", "steps_per_sec", "examples_per_sec"):
        assert train_tags[tag] == [3, 4, 7], tag  # loops end at 3, 4 (eval point), 7 (end)
    assert "config" in train_tags
    eval_tags = _scalars(tmp_path / "eval")
    assert eval_tags["loss"] == [4, 7] and eval_tags["accuracy"] == [4, 7]


def test_resumed_run_continues_the_step_axis(tmp_path):
    train(small_config(tmp_path, train_steps=3), out=open(os.devnull, "w"))
    train(small_config(tmp_path, train_steps=6), out=open(os.devnull, "w"))
    assert sorted(_scalars(tmp_path / "train")["loss"]) == [3, 6]


def test_non_chief_writes_nothing(tmp_path):
    writers = create_writers(str(tmp_path), is_chief=False)
    writers["train"].write_scalars(1, {"loss": 1.0})
    writers["train"].close()
    assert os.listdir(tmp_path) == []
