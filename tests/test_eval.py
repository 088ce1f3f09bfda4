"""Evaluation covers every example (partial last batch too) and equals Keras' own evaluate."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from helpers import QUIET, REPO, TASKS_REFUSED, small_config
from engine.data.builtin import synthetic_arrays
from engine.errors import UserError
from engine import compat
from engine.loop import make_eval_loop, make_train_loop
from engine.controller.state import build_task
from engine.distribute.strategy import build_strategy
from engine.task import Task
from engine.controller.trainer import train


@pytest.mark.parametrize("replicas", [1, 2])
def test_eval_matches_keras_evaluate(tmp_path, replicas):
    # 301 test examples at a global batch of 64: 4 full batches and one of 45, split 23/22.
    config = small_config(
        tmp_path, strategy="mirrored", cpu_replicas=replicas, synthetic_test_examples=301, export=True
    )
    result = train(config, **QUIET)
    model = keras.models.load_model(os.path.join(tmp_path, "export", "model.keras"))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    images, labels = synthetic_arrays(301, seed=2)
    loss, accuracy = model.evaluate(
        images[..., None].astype("float32") / 255.0, labels.astype("int32"), batch_size=50, verbose=0
    )
    assert result.eval_metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert result.eval_metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.fast
def test_eval_counts_every_example():
    strategy = build_strategy("mirrored", 2).strategy  # the engine's (not collective all-reduce)
    config = small_config("/unused")

    class CountingTask(Task):
        eval_metrics = ("examples",)

        def eval_step(self, batch):
            _, labels = batch
            return {"examples": (tf.cast(tf.shape(labels)[0], tf.float32), tf.constant(1.0))}

    task = CountingTask(config, input_shape=(28, 28, 1), num_classes=10)
    images, labels = synthetic_arrays(301, seed=2)
    from engine.data.arrays import eval_dataset

    dataset = strategy.experimental_distribute_dataset(eval_dataset(images, labels, 64))
    result = make_eval_loop(strategy, task)(dataset)
    total, _ = result["totals"]["examples"]
    assert float(total) == 301 and float(result["examples"]) == 301  # the Task's count and the engine's


def test_train_loop_traces_once_for_any_loop_length():
    strategy = build_strategy("mirrored", 2).strategy  # the engine's (not collective all-reduce)
    config = small_config("/unused")
    task = Task(config, input_shape=(28, 28, 1), num_classes=10)
    with strategy.scope():
        build_task(strategy, task)
        step = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    from engine.data.arrays import train_dataset

    images, labels = synthetic_arrays(512, seed=1)
    iterator = iter(strategy.experimental_distribute_dataset(train_dataset(images, labels, 64, seed=1)))
    loop = make_train_loop(strategy, task, step)
    for num_steps in (1, 3, 2, 5):
        result = loop(iterator, tf.constant(num_steps))
        assert int(result["steps"]) == num_steps and int(result["bad_steps"]) == 0
        assert float(result["totals"]["loss"][1]) == num_steps * 64
    assert loop.experimental_get_tracing_count() == 1
    assert int(step.numpy()) == 11


def _traced_loop_graphs() -> int:
    return sum(
        1
        for o in gc.get_objects()
        if type(o).__name__ == "FuncGraph" and getattr(o, "name", "") in ("train_loop", "eval_loop")
    )


def _custom_gradients() -> int:
    return sum(1 for name in compat.custom_gradient_registry() if str(name).startswith(compat.CUSTOM_GRADIENT_PREFIX))


def test_a_finished_run_leaves_no_traced_graph_in_memory(tmp_path):
    # Every replica-context all-reduce (the gradient sum; synchronised batch norm's statistics in
    # cnn_bn) registers a custom gradient in TensorFlow's global registry that holds its graph: without
    # engine.loop.released_after_tracing each train() in a process kept its loops (~75 MB for the cnn).
    gc.collect()
    graphs, registered = _traced_loop_graphs(), _custom_gradients()
    for run in range(2):
        config = small_config(
            tmp_path / str(run), strategy="mirrored", cpu_replicas=2, model="cnn_bn", grad_accum_steps=2
        )
        result = train(config, **QUIET)
        assert result.final_step == 6 and result.train_metrics["loss"] < 10  # it trained (gradients built)
        del result
        gc.collect()
        assert _custom_gradients() == registered
        assert _traced_loop_graphs() <= graphs


# Six runs' eval loops in a fresh process (TensorFlow's retracing detector warns at most twice per
# Python function per process, so earlier tests in this one could hide the warning).
_SIX_RUNS_EVAL_LOOPS = """
import sys
sys.path.insert(0, "tests")
from helpers import small_config
from engine.controller.state import build_task
from engine.data.arrays import eval_dataset
from engine.data.builtin import synthetic_arrays
from engine.distribute.strategy import build_strategy
from engine.loop import make_eval_loop
from engine.task import Task

strategy = build_strategy("default", 1).strategy
task = Task(small_config("/unused", model="mlp"), input_shape=(28, 28, 1), num_classes=10)
with strategy.scope():
    build_task(strategy, task)
data = strategy.experimental_distribute_dataset(eval_dataset(*synthetic_arrays(64, seed=1), 32))
for run in range(6):  # what six train() runs in one process (a sweep, a notebook) build
    print(run, float(make_eval_loop(strategy, task)(data)["examples"]), flush=True)
"""


def test_each_runs_loops_do_not_warn_of_retracing():
    proc = subprocess.run(
        [sys.executable, "-c", _SIX_RUNS_EVAL_LOOPS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(word) for run in range(6) for word in (run, 64.0)]
    assert "retracing" not in proc.stderr, proc.stderr[-2000:]


def test_undeclared_metric_names_are_a_clear_error(tmp_path):
    config = small_config(tmp_path, task=f"{TASKS_REFUSED}:WrongMetricsTask")
    with pytest.raises(UserError, match="eval_step returned"):
        train(config, **QUIET)


class _NoisyEvalTask(Task):
    """A sampled evaluation (a VAE's ELBO, a denoiser's score): eval_step adds per-example noise
    from self.example_normal to the images before scoring them."""

    eval_metrics = ("loss", "noise")

    def eval_step(self, batch):
        images, labels = batch
        n = tf.shape(labels)[0]
        noise = self.example_normal(n, self.input_shape)
        losses = self.per_example_loss(labels, self.model(images + noise, training=False))
        return {
            "loss": (tf.reduce_sum(losses), tf.cast(n, tf.float32)),
            "noise": (tf.reduce_sum(noise), tf.cast(n, tf.float32)),
        }


def _sampled_eval(replicas: int, global_batch: int) -> dict:
    strategy = build_strategy("mirrored", replicas).strategy
    with strategy.scope():
        task = _NoisyEvalTask(small_config("/unused"), input_shape=(28, 28, 1), num_classes=10)
        keras.utils.set_random_seed(3)  # the same weights on every layout
        task.model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
        task.seed, task.global_step = 7, tf.Variable(5, dtype=tf.int64, trainable=False)
    from engine.data.arrays import eval_dataset

    images, labels = synthetic_arrays(301, seed=2)
    dataset = strategy.experimental_distribute_dataset(eval_dataset(images, labels, global_batch))
    totals = make_eval_loop(strategy, task)(dataset)["totals"]
    return {name: float(total) / float(count) for name, (total, count) in totals.items()}


def test_a_sampled_evaluation_is_the_same_on_any_replica_count_and_batch_size():
    one = _sampled_eval(1, 64)
    assert one["noise"] != 0.0  # the noise was drawn
    assert _sampled_eval(1, 64) == one  # repeatable
    for replicas, batch in ((2, 64), (2, 50), (1, 301)):
        other = _sampled_eval(replicas, batch)
        assert other["loss"] == pytest.approx(one["loss"], rel=1e-5), (replicas, batch)
        assert other["noise"] == pytest.approx(one["noise"], rel=1e-5), (replicas, batch)
