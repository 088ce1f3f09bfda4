"""--run_eagerly: the Task's train_step and eval_step run as plain Python (a step that prints
.numpy() values trains), with the compiled loop's guarantees: the same weights as the compiled run
on 1 and 2 replicas with micro-batches, the finite check's stop at the same step, a resume from a
compiled run's checkpoint; and the one-line refusals of what an eager step cannot be."""

from __future__ import annotations

import re

import pytest

from helpers import QUIET, TASKS_EAGER, TASKS_NONFINITE, max_difference, small_config, trained_by_name
from tasks_eager import EVAL_LINE, TRAIN_LINE
from engine.controller.trainer import train
from engine.errors import NonFiniteLoss, UserError

TWO_REPLICAS = dict(strategy="mirrored", cpu_replicas=2)
# 6 steps of 64 in loops of 3, two micro-batches per replica: the engine's sum over micro-batches
# and replicas runs eagerly too. One evaluation (at the end) of the 300 test examples (no preflight:
# its evaluation of one batch would print too).
RUN = dict(model="mlp", grad_accum_steps=2, preflight=False)
STEPS, BATCH, TEST_EXAMPLES = 6, 64, 300


def _printed(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


@pytest.mark.parametrize("layout", [{}, TWO_REPLICAS], ids=["one_replica", "mirrored2"])
def test_a_step_that_prints_numpy_values_trains_eagerly_like_the_compiled_run(tmp_path, capsys, layout):
    compiled = trained_by_name(tmp_path / "compiled", **RUN)  # the default Task, compiled, one replica
    capsys.readouterr()
    eager = trained_by_name(tmp_path / "eager", task=f"{TASKS_EAGER}:PrintingTask", run_eagerly=True, **RUN, **layout)
    printed = capsys.readouterr().out
    # N replicas x K micro-batches == one replica, eagerly as compiled (summation order differs).
    assert max_difference(compiled, eager) < 1e-5
    # The step ran as Python once per replica, micro-batch and step, each on its share of the batch.
    replicas = 2 if layout else 1
    train_lines = _printed(printed, TRAIN_LINE)
    assert len(train_lines) == STEPS * replicas * 2, printed[-2000:]
    steps = [int(re.search(r" step (\d+) ", line).group(1)) for line in train_lines]
    assert sorted(steps) == sorted(list(range(STEPS)) * replicas * 2)
    assert all(f" examples {BATCH // (replicas * 2)} " in line for line in train_lines)
    assert {int(re.search(r"replica (\d+)", line).group(1)) for line in train_lines} == set(range(replicas))
    # eval_step too, over every test example once.
    eval_examples = [int(line.rsplit(" ", 1)[1]) for line in _printed(printed, EVAL_LINE)]
    assert sum(eval_examples) == TEST_EXAMPLES


def test_the_finite_check_stops_an_eager_run_at_the_bad_step(tmp_path):
    """NaN gradients on the last of 2 replicas at the 6th step: the eager loop stops there, as the
    compiled one does (tests/test_nonfinite.py), with the last good checkpoint kept."""
    config = small_config(
        tmp_path,
        task=f"{TASKS_NONFINITE}:NanGradientTask",
        train_steps=9,
        checkpoint_every=3,
        run_eagerly=True,
        model="mlp",
        **TWO_REPLICAS,
    )
    with pytest.raises(NonFiniteLoss, match="at step 6 .*nothing saved after step 3"):
        train(config, **QUIET)


def test_an_eager_run_resumes_a_compiled_runs_checkpoint(tmp_path):
    """Compiled for 3 steps, then resumed eagerly to 6 (weights, optimizer state, data position and
    step count from the checkpoint): the same weights as 6 compiled steps."""
    straight = trained_by_name(tmp_path / "straight", **RUN, **TWO_REPLICAS)
    trained_by_name(tmp_path / "resumed", train_steps=3, **RUN, **TWO_REPLICAS)
    resumed = trained_by_name(tmp_path / "resumed", train_steps=STEPS, run_eagerly=True, **RUN, **TWO_REPLICAS)
    assert max_difference(straight, resumed) < 1e-5


@pytest.mark.fast
@pytest.mark.parametrize("flag", ["jit_compile", "trace_graph"])
def test_what_an_eager_step_cannot_be_is_refused_in_one_line(tmp_path, flag):
    config = small_config(tmp_path, model="mlp", run_eagerly=True, **{flag: True})
    with pytest.raises(UserError, match=f"--run_eagerly with --{flag}: ") as refusal:
        train(config, **QUIET)
    assert "\n" not in str(refusal.value)
