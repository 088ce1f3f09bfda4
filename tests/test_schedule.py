"""Periodic actions as pure functions of the step (explicit step numbers, no training)."""

from __future__ import annotations

import pytest

from engine.errors import UserError
from engine.controller.schedule import Schedule

pytestmark = pytest.mark.fast  # every test here runs in seconds: the fast lane (-m fast)


def _loops(schedule, start=0):
    step, ends = start, []
    while step < schedule.total_steps:
        step += schedule.next_loop_steps(step)
        ends.append(step)
    return ends


def test_loops_stop_at_eval_checkpoint_and_end():
    schedule = Schedule(total_steps=25, steps_per_epoch=10, steps_per_loop=4, checkpoint_every=6)
    assert _loops(schedule) == [4, 6, 10, 12, 16, 18, 20, 24, 25]
    assert [s for s in _loops(schedule) if schedule.eval_due(s)] == [10, 20, 25]
    assert [s for s in _loops(schedule) if schedule.checkpoint_due(s)] == [6, 12, 18, 24, 25]


def test_resume_mid_epoch_continues_the_same_boundaries():
    schedule = Schedule(total_steps=30, steps_per_epoch=10, steps_per_loop=100)
    assert _loops(schedule, start=13) == [20, 30]


def test_epochs_and_bad_values():
    schedule = Schedule(total_steps=30, steps_per_epoch=10, steps_per_loop=5)
    assert schedule.epoch(29) == 2 and schedule.epoch(30) == 3
    with pytest.raises(UserError, match="steps_per_loop"):
        Schedule(total_steps=30, steps_per_epoch=10, steps_per_loop=0)


def test_loops_also_stop_at_histogram_steps_and_marks():
    schedule = Schedule(total_steps=20, steps_per_epoch=20, steps_per_loop=8, histogram_every=6, marks=(3, 13))
    assert _loops(schedule) == [3, 6, 12, 13, 18, 20]
    assert [s for s in range(21) if schedule.histogram_due(s)] == [0, 6, 12, 18]


def test_eval_every_minus_one_never_evaluates_nor_cuts_loops():
    """--eval_every=-1 (a sidecar evaluates): no eval step, not even the last; loops end only at
    checkpoints and the end."""
    schedule = Schedule(total_steps=30, steps_per_epoch=10, steps_per_loop=7, eval_every=-1, checkpoint_every=15)
    assert not any(schedule.eval_due(s) for s in range(31))
    assert _loops(schedule) == [7, 14, 15, 22, 29, 30]
