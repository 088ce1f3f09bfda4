"""The worked examples of examples/ (docs/examples.md): each trains, and each keeps the engine's
guarantees with several models and optimizers: 2 replicas == 1, exact resume of both GAN models and
both optimizers, SAM under accumulation, k discriminator steps per generator step, a frozen teacher
that never moves, training that survives crashing summaries."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO, TEST_TASKS, checkpoint_state, small_config

from engine.controller.trainer import train
from engine.errors import ExtraFailed, UserError
from engine.task_state import top_level_names

QUIET = dict(out=open(os.devnull, "w"))
TWO = dict(strategy="mirrored", cpu_replicas=2)
STATE = ("model/", "optimizer/", "task/")
EXAMPLES = {name: os.path.join(REPO, "examples", f"{file}.py:{name}") for file, name in (
    ("sam", "SamTask"), ("distillation", "DistillationTask"), ("gradient_penalty", "GradientPenaltyTask"),
    ("gan", "GanTask"), ("gan", "TwoDiscriminatorStepsGanTask"))}


def _config(tmp_path, example, name="run", **overrides):
    return small_config(tmp_path / name, **{"task": EXAMPLES[example], "model": "mlp", **overrides})


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a if a[k].dtype.kind == "f")


def _iterations(model_dir, node) -> int:
    state = checkpoint_state(model_dir, prefixes=(node + "/",))
    return int(next(v for k, v in state.items() if k.startswith(node + "/_iterations")))


@pytest.mark.fast
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_trains(tmp_path, example):
    result = train(_config(tmp_path, example), **QUIET)
    assert result.final_step == 6
    assert all(np.isfinite(v) for v in result.train_metrics.values()), result.train_metrics


@pytest.mark.parametrize("example", ["GanTask", "SamTask"])
def test_two_replicas_train_like_one(tmp_path, example):
    train(_config(tmp_path, example, "two", train_steps=20, steps_per_loop=10, **TWO), **QUIET)
    train(_config(tmp_path, example, "one", train_steps=20, steps_per_loop=10, strategy="default"), **QUIET)
    assert _max_difference(checkpoint_state(tmp_path / "two", STATE), checkpoint_state(tmp_path / "one", STATE)) <= 1e-5


def test_a_resumed_gan_equals_an_uninterrupted_one(tmp_path):
    train(_config(tmp_path, "GanTask", "resumed", train_steps=20, steps_per_loop=10), **QUIET)
    latest = tf.train.latest_checkpoint(os.path.join(tmp_path, "resumed", "checkpoints"))
    assert top_level_names(latest, "task") == {"discriminator", "d_optimizer"}
    train(_config(tmp_path, "GanTask", "resumed", train_steps=40, steps_per_loop=10), **QUIET)
    train(_config(tmp_path, "GanTask", "straight", train_steps=40, steps_per_loop=10), **QUIET)
    resumed, straight = checkpoint_state(tmp_path / "resumed", STATE), checkpoint_state(tmp_path / "straight", STATE)
    assert _max_difference(resumed, straight) <= 1e-6
    assert _iterations(tmp_path / "resumed", "task/d_optimizer") == 40


@pytest.mark.fast
def test_sam_trains_with_accumulated_micro_batches(tmp_path):
    result = train(_config(tmp_path, "SamTask", grad_accum_steps=2, **TWO), **QUIET)
    assert np.isfinite(result.train_metrics["loss"])


@pytest.mark.fast
def test_k_discriminator_steps_per_generator_step(tmp_path):
    train(_config(tmp_path, "TwoDiscriminatorStepsGanTask", **TWO), **QUIET)
    assert _iterations(tmp_path / "run", "task/d_optimizer") == 6
    assert _iterations(tmp_path / "run", "optimizer") == 3


@pytest.mark.fast
def test_the_frozen_teacher_is_checkpointed_and_never_moves(tmp_path):
    train(_config(tmp_path, "DistillationTask", "short", train_steps=3), **QUIET)
    train(_config(tmp_path, "DistillationTask", "long", train_steps=9), **QUIET)
    short, long = (checkpoint_state(tmp_path / n, ("task/teacher/",)) for n in ("short", "long"))
    assert short and _max_difference(short, long) == 0.0


@pytest.mark.fast
def test_a_gan_whose_summaries_crash_keeps_its_checkpoint(tmp_path):
    with pytest.raises(ExtraFailed, match="the summaries crash on purpose"):
        train(small_config(tmp_path, task=f"{TEST_TASKS}:CrashingSummariesGanTask", model="mlp"), **QUIET)
    assert tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints")).endswith("ckpt-6")


@pytest.mark.fast
def test_a_gan_checkpoint_into_a_task_without_the_discriminator_is_refused(tmp_path):
    train(_config(tmp_path, "GanTask"), **QUIET)
    with pytest.raises(UserError, match=r"holds self\.d_optimizer, which this Task does not have"):
        train(small_config(tmp_path / "run", task=f"{TEST_TASKS}:GanWithoutDiscriminatorTask", model="mlp",
                           train_steps=12, allow_config_change=True), **QUIET)
