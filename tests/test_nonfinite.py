"""Non-finite losses and gradients: --on_nonfinite=stop ends the run at the bad step without
saving it; --on_nonfinite=skip leaves weights and optimizer state as if the step never happened.
The NaN is injected on the LAST replica only, so the decision must come from an all-reduced flag."""

from __future__ import annotations


import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, TASKS_NONFINITE, TINY_FLAGS, checkpoint_state, run_cli, small_config
from tasks_nonfinite import NanLossTask
from engine.controller.state import create_state
from engine.controller.trainer import train
from engine.data.arrays import train_dataset
from engine.data.builtin import synthetic_arrays
from engine.distribute.strategy import build_strategy
from engine.errors import NonFiniteLoss
from engine.loop import LoopOptions, make_train_loop

TWO_REPLICAS = dict(strategy="mirrored", cpu_replicas=2)
NAN_AT = 5  # tests/tasks_nonfinite.py: the update from global step 5 to 6 (the 6th step) is poisoned


def _latest_step(model_dir):
    return int(checkpoint_state(model_dir)["global_step/.ATTRIBUTES/VARIABLE_VALUE"])


# The bad step last in its loop (steps 4-6), and in the middle of one (steps 5-8: the loop stops there).
@pytest.mark.parametrize("task, steps_per_loop", [("NanGradientTask", 3), ("NanLossTask", 3), ("NanLossTask", 4)])
def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, task, steps_per_loop):
    config = small_config(
        tmp_path,
        task=f"{TASKS_NONFINITE}:{task}",
        train_steps=12,
        steps_per_loop=steps_per_loop,
        checkpoint_every=steps_per_loop,
        **TWO_REPLICAS,
    )
    with pytest.raises(NonFiniteLoss, match=f"step {NAN_AT + 1} .*nothing saved after step {steps_per_loop}"):
        train(config, **QUIET)
    assert _latest_step(tmp_path) == steps_per_loop  # the loop with the bad step was never saved
    state = checkpoint_state(tmp_path)
    assert all(np.all(np.isfinite(value)) for value in state.values())
    # The last good checkpoint loads: the same run with a clean task resumes from it.
    resumed = train(config.replace(task="classification", allow_config_change=True, train_steps=6), **QUIET)
    assert resumed.start_step == steps_per_loop and resumed.final_step == 6


# The bad step (the 6th) in the middle of a loop and last in it, with stop; with skip.
@pytest.mark.parametrize("num_steps, mode", [(9, "stop"), (NAN_AT + 1, "stop"), (9, "skip")])
def test_the_loop_counts_sums_and_steps_exactly_the_good_steps(tmp_path, num_steps, mode):
    """With stop, the loop counts, sums and leaves global_step at exactly the good steps before the
    bad one, wherever it falls in the loop; with skip, every step counts, and all but the bad one's
    metrics, and the next loop goes on from there."""
    strategy = build_strategy("mirrored", 2).strategy
    task = NanLossTask(small_config(tmp_path, on_nonfinite=mode), input_shape=(28, 28, 1), num_classes=10)
    task.total_steps = 100
    state = create_state(strategy, task, seed=1, model_dir=str(tmp_path), is_chief=True, keep=1)
    images, labels = synthetic_arrays(1024, seed=1)
    iterator = iter(strategy.experimental_distribute_dataset(train_dataset(images, labels, 64, seed=1)))
    loop = make_train_loop(strategy, task, state.global_step, LoopOptions(skip_nonfinite=mode == "skip"))
    result = loop(iterator, tf.constant(num_steps))
    counted, summed = (num_steps, num_steps - 1) if mode == "skip" else (NAN_AT, NAN_AT)
    assert int(result["steps"]) == counted and int(result["bad_steps"]) == 1
    assert int(state.global_step.numpy()) == counted
    loss, examples = (float(value) for value in result["totals"]["loss"])
    assert examples == summed * 64 and np.isfinite(loss)
    assert int(result["skipped_updates"]) == (1 if mode == "skip" else 0)  # stop: the update ran beside
    if mode == "stop":
        return
    more = loop(iterator, tf.constant(2))  # skip goes on: the next loop starts where this one ended
    assert int(more["steps"]) == 2 and int(more["bad_steps"]) == 0 and int(state.global_step.numpy()) == counted + 2


@pytest.mark.parametrize(
    "task, strategy",
    [
        ("NanGradientTask", TWO_REPLICAS),
        ("NanLossTask", dict(strategy="default", deterministic=True)),
        ("NanInputTask", dict(model="cnn_bn", **TWO_REPLICAS)),
        # unrolled micro-batches each move the statistics
        ("NanInputTask", dict(model="cnn_bn", grad_accum_steps=2, **TWO_REPLICAS)),
    ],
)
def test_skip_leaves_weights_and_optimizer_untouched(tmp_path, task, strategy):
    # The poisoned step is the last one, so skipping it must leave the state of a clean 5-step run.
    skipped = train(
        small_config(
            tmp_path / "skip", task=f"{TASKS_NONFINITE}:{task}", on_nonfinite="skip", train_steps=NAN_AT + 1, **strategy
        ),
        **QUIET,
    )
    assert skipped.skipped_steps == 1 and skipped.final_step == NAN_AT + 1
    assert np.isfinite(skipped.eval_metrics["loss"]) and np.isfinite(skipped.train_metrics["loss"])
    train(small_config(tmp_path / "clean", train_steps=NAN_AT, **strategy), **QUIET)
    after_skip, clean = checkpoint_state(tmp_path / "skip"), checkpoint_state(tmp_path / "clean")
    assert int(after_skip.pop("global_step/.ATTRIBUTES/VARIABLE_VALUE")) == NAN_AT + 1  # the batch was consumed
    clean.pop("global_step/.ATTRIBUTES/VARIABLE_VALUE")
    assert sorted(after_skip) == sorted(clean)
    for name in clean:  # weights, batch-norm moving statistics, Adam moments and iterations
        assert np.array_equal(after_skip[name], clean[name]), name


def test_cli_stop_exits_4_with_the_step(tmp_path):
    proc = run_cli(
        *TINY_FLAGS,
        "--train_steps=8",
        "--checkpoint_every=2",
        f"--task={TASKS_NONFINITE}:NanLossTask",
        f"--model_dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: non-finite loss or gradient at step 6"), proc.stderr[-2000:]
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-4")
