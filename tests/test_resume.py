"""Exact resume: a run stopped at any step and resumed ends where the uninterrupted run ends.

Each test stops a run several times (between loops, inside a loop's span, exactly at an epoch end)
by running it with a smaller --train_steps, resumes it from its model_dir, and compares every
model AND optimizer variable of the final checkpoint with an uninterrupted run's.
"""

from __future__ import annotations

import io
import json

import numpy as np

from helpers import QUIET, SMALL_RUN, TASKS_EQUIVALENCE, checkpoint_state, max_difference, small_config
from engine.controller.trainer import train

# 1024 examples / batch 64 = 16 steps per epoch; loops of 3 steps.
STOPS = (6, 7, 16)  # a loop boundary; mid-loop and mid-epoch; exactly the end of epoch 1
TOTAL = 20  # into the second epoch (a reshuffled order)


def _stopped_and_straight(tmp_path, **overrides):
    config = small_config(tmp_path / "stopped", train_steps=TOTAL, **overrides)
    for stop in STOPS:
        result = train(config.replace(train_steps=stop), **QUIET)
        assert result.final_step == stop
    resumed = train(config, **QUIET)
    assert resumed.start_step == STOPS[-1] and resumed.final_step == TOTAL
    train(config.replace(model_dir=str(tmp_path / "straight")), **QUIET)
    stopped, straight = checkpoint_state(tmp_path / "stopped"), checkpoint_state(tmp_path / "straight")
    assert sorted(stopped) == sorted(straight) and len(stopped) > 4
    assert int(stopped["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == TOTAL
    return stopped, straight


def test_resume_one_replica_deterministic_is_bitwise(tmp_path):
    stopped, straight = _stopped_and_straight(tmp_path, strategy="default", deterministic=True)
    different = [name for name in stopped if not np.array_equal(stopped[name], straight[name])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


def test_resume_two_replicas_matches_within_tolerance(tmp_path):
    """With Dropout and Task.random_seed noise: the random streams continue where they stopped."""
    stopped, straight = _stopped_and_straight(
        tmp_path, strategy="mirrored", cpu_replicas=2, task=f"{TASKS_EQUIVALENCE}:DropoutTask"
    )
    for name in stopped:
        np.testing.assert_allclose(stopped[name], straight[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_resume_on_one_replica_of_a_two_replica_run_matches_an_undisturbed_run(tmp_path):
    """Another layout on resume (the same --global_batch): 2 replicas for 3 steps, then 1 for the
    rest, ends like 1 replica all along; the banner and the record name the layout change."""
    config = small_config(tmp_path / "changed", model="mlp")
    train(config.replace(strategy="mirrored", cpu_replicas=2, train_steps=3), **QUIET)
    out = io.StringIO()
    resumed = train(config, out=out)
    assert resumed.start_step == 3 and resumed.final_step == SMALL_RUN["train_steps"]
    assert (
        "changed      layout 1 worker x 2 replicas -> 1 worker x 1 replica at step 3 (the same global batch, "
        "so training continues as if it had this layout from that step)"
    ) in out.getvalue().splitlines()
    record = json.loads((tmp_path / "changed" / "config.json").read_text())
    assert record["layout"] == "1 worker x 1 replica"
    assert {"step": 3, "fact": "layout", "from": "1 worker x 2 replicas", "to": "1 worker x 1 replica"} in record[
        "changes"
    ]
    train(config.replace(model_dir=str(tmp_path / "straight")), **QUIET)
    difference = max_difference(checkpoint_state(tmp_path / "changed"), checkpoint_state(tmp_path / "straight"))
    assert difference < 1e-6, difference  # float32 sums in another order
