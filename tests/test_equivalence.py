"""N replicas train exactly like one replica fed the same global batch (invariants 2-4, 10)."""

from __future__ import annotations


import numpy as np
import pytest

from helpers import QUIET, TASKS_EQUIVALENCE, exported_weights, max_difference, small_config
from engine.controller.trainer import train


def _trained_weights(tmp_path, name, **overrides):
    model_dir = tmp_path / name
    train(small_config(model_dir, export=True, **overrides), **QUIET)
    return exported_weights(model_dir)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_replicas_match_one(tmp_path, optimizer):
    one = _trained_weights(tmp_path, "one", strategy="mirrored", cpu_replicas=1, optimizer=optimizer)
    two = _trained_weights(tmp_path, "two", strategy="mirrored", cpu_replicas=2, optimizer=optimizer)
    untrained = _trained_weights(
        tmp_path, "zero", strategy="mirrored", cpu_replicas=1, optimizer=optimizer, train_steps=1, learning_rate=0.0
    )
    assert max_difference(one, untrained) > 1e-3, "training must move the weights"
    assert max_difference(one, two) < 1e-5


def test_default_strategy_matches_mirrored(tmp_path):
    default = _trained_weights(tmp_path, "default", strategy="default", optimizer="sgd")
    mirrored = _trained_weights(tmp_path, "mirrored", strategy="mirrored", cpu_replicas=2, optimizer="sgd")
    assert max_difference(default, mirrored) < 1e-5


def test_per_replica_mean_loss_breaks_equivalence(tmp_path):
    """The same comparison fails when each replica divides by its own batch: the gradients,
    summed over 2 replicas, come out twice as large. This is why engine.losses.replica_loss
    divides by the GLOBAL batch."""
    task = f"{TASKS_EQUIVALENCE}:PerReplicaMeanTask"
    one = _trained_weights(tmp_path, "one", strategy="mirrored", cpu_replicas=1, optimizer="sgd", task=task)
    two = _trained_weights(tmp_path, "two", strategy="mirrored", cpu_replicas=2, optimizer="sgd", task=task)
    assert max_difference(one, two) > 1e-3


def test_seeded_deterministic_runs_repeat_bitwise(tmp_path):
    first = _trained_weights(tmp_path, "a", strategy="default", deterministic=True, train_steps=4)
    second = _trained_weights(tmp_path, "b", strategy="default", deterministic=True, train_steps=4)
    assert all(np.array_equal(x, y) for x, y in zip(first, second))
    other_seed = _trained_weights(tmp_path, "c", strategy="default", deterministic=True, train_steps=4, seed=8)
    assert max_difference(first, other_seed) > 1e-3
