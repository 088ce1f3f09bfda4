"""The benchmark's FLOP count (its numbers are measured by running it, never by a timed test)."""

from __future__ import annotations

import pytest

from benchmarks.throughput import training_flops_per_example
from engine.models.registry import build_model

pytestmark = pytest.mark.fast  # every test here runs in seconds: the fast lane (-m fast)


def test_seed_cnn_training_flops():
    forward = 2 * (26 * 26 * 32 * 3 * 3 * 1 + 5408 * 128 + 128 * 10)  # conv, dense 128, dense 10
    assert training_flops_per_example(build_model("cnn", (28, 28, 1), 10)) == 3 * forward
