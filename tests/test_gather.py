"""Task.all_gather (engine/step_context.py): every replica's values in replica order with the
gradient of a gather, one gather rather than a padded all-reduce, SimCLR's NT-Xent over the global
batch with N replicas == 1 (examples/simclr.py), with accumulation, on two workers, and a raw
replica-context collective where TensorFlow cannot run one refused in one line."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import tensorflow as tf
from helpers import QUIET, REPO, exported_weights, run_cli, small_config

from engine.controller.trainer import train
from engine.distribute.strategy import build_strategy
from engine.task import Task

SIMCLR = os.path.join(REPO, "examples", "simclr.py:SimclrTask")
TASKS = os.path.join(REPO, "tests", "tasks_gather.py")
# One SGD step of SimCLR on the mlp (synthetic data): large rate, so a wrong gradient shows.
ONE_STEP = dict(task=SIMCLR, model="mlp", optimizer="sgd", learning_rate=0.5, train_steps=1, steps_per_loop=1)


def _task():
    return Task(small_config("unused"), input_shape=(2,), num_classes=2)


def _max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _trained(tmp_path, name, **overrides):
    result = train(small_config(tmp_path / name, export=True, **overrides), **QUIET)
    return exported_weights(tmp_path / name), result


def _on_replicas(strategy, step, values):
    """step(this replica's value, replica id) run on every replica -> per replica, its results."""
    distributed = strategy.experimental_distribute_values_from_function(
        lambda context: values[context.replica_id_in_sync_group]
    )

    @tf.function
    def run(value):
        def replica(x):
            return step(x, tf.distribute.get_replica_context().replica_id_in_sync_group)

        return strategy.run(replica, args=(value,))

    results = run(distributed)
    local = [strategy.experimental_local_results(t) for t in tf.nest.flatten(results)]
    return [
        tf.nest.pack_sequence_as(results, [t[i].numpy() for t in local]) for i in range(strategy.num_replicas_in_sync)
    ]


@pytest.mark.fast
def test_gather_concatenates_in_replica_order_with_the_gradient_of_a_gather():
    """Replica r holds rows X_r and its loss is (r + 1) * sum(W * gathered): the gathered batch is
    [X_0; X_1] on both, and replica r's gradient is the upstream gradient summed over replicas on
    its own rows, (1 + 2) * W[rows of r]."""
    strategy = build_strategy("mirrored", 2).strategy
    task = _task()
    values = [tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([[11.0, 12.0], [13.0, 14.0], [15.0, 16.0]])]
    weights = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2])

    def step(x, replica_id):
        with tf.GradientTape() as tape:
            tape.watch(x)
            rows, doubled = task.all_gather([x, 2 * x])  # a list: each gathered (uneven rows too)
            loss = tf.cast(replica_id + 1, tf.float32) * tf.reduce_sum(weights * rows)
        return rows, doubled, tape.gradient(loss, x)

    expected = np.concatenate([v.numpy() for v in values])
    for replica, (rows, doubled, gradient) in enumerate(_on_replicas(strategy, step, values)):
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_array_equal(doubled, 2 * expected)
        own = slice(0, 2) if replica == 0 else slice(2, 5)
        np.testing.assert_allclose(gradient, 3.0 * weights.numpy()[own])

    def along_columns(x, replica_id):
        return task.all_gather(x, axis=1)

    square = [tf.constant([[1.0], [2.0]]), tf.constant([[3.0], [4.0]])]
    for gathered in _on_replicas(strategy, along_columns, square):
        np.testing.assert_array_equal(gathered, [[1.0, 3.0], [2.0, 4.0]])


@pytest.mark.fast
@pytest.mark.parametrize("name", ["default", "one_device"])
def test_gather_on_one_device_is_the_identity(name):
    strategy = build_strategy(name).strategy
    task, x = _task(), tf.constant([[1.0, 2.0], [3.0, 4.0]])

    @tf.function
    def run():
        def replica():
            with tf.GradientTape() as tape:
                tape.watch(x)
                gathered = task.all_gather(x)
                loss = tf.reduce_sum(gathered * gathered)
            return gathered, tape.gradient(loss, x)

        return strategy.run(replica)

    gathered, gradient = run()
    np.testing.assert_array_equal(gathered.numpy(), x.numpy())
    np.testing.assert_array_equal(gradient.numpy(), 2 * x.numpy())


def _op_shapes(graph, op_type) -> list:
    """The output shapes of every `op_type` op in `graph` and the functions it calls."""
    shapes = [tuple(op.outputs[0].shape) for op in graph.get_operations() if op.type == op_type]
    for function in graph._functions.values():
        if hasattr(function, "graph"):
            shapes += _op_shapes(function.graph, op_type)
    return shapes


@pytest.mark.fast
def test_gather_sends_each_value_once_not_a_padded_buffer():
    """On the engine's CPU mirrored strategy (reduced through one device) a gather concatenates each
    replica's [n, d] rows once; the workaround the issue measured, each replica's rows in a
    zero-padded [R n, d] buffer summed by an all-reduce, adds R buffers of the global size."""
    strategy = build_strategy("mirrored", 2).strategy
    task, n, d = _task(), 4, 3

    def gathered(x):
        return task.all_gather(x)

    def padded(x):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        buffer = tf.scatter_nd(tf.reshape(replica * n + tf.range(n), [n, 1]), x, [2 * n, d])
        return task.all_reduce(buffer)

    def graph_of(step):
        function = tf.function(lambda x: strategy.run(step, args=(x,)))
        value = strategy.experimental_distribute_values_from_function(lambda _: tf.ones([n, d]))
        return function.get_concrete_function(value).graph

    gather_graph, padded_graph = graph_of(gathered), graph_of(padded)
    assert (2 * n, d) in _op_shapes(gather_graph, "ConcatV2")  # [x_0; x_1], each sent once
    assert _op_shapes(gather_graph, "AddN") == []  # no all-reduce at all
    assert (2 * n, d) in _op_shapes(padded_graph, "AddN")  # the padded buffers, summed


def test_simclr_two_replicas_match_one_after_one_sgd_step(tmp_path):
    """NT-Xent over the global batch (every view of the other examples of every replica is a
    negative): one SGD step on 2 replicas moves the weights as on 1 replica fed the same batch."""
    one, _ = _trained(tmp_path, "one", strategy="mirrored", cpu_replicas=1, **ONE_STEP)
    two, _ = _trained(tmp_path, "two", strategy="mirrored", cpu_replicas=2, **ONE_STEP)
    untrained, _ = _trained(tmp_path, "zero", strategy="mirrored", cpu_replicas=1, **{**ONE_STEP, "learning_rate": 0.0})
    assert _max_difference(one, untrained) > 1e-2  # the step moved the weights
    assert _max_difference(one, two) < 1e-6


def test_simclr_evaluates_alike_on_uneven_eval_batches(tmp_path):
    """eval_step gathers too: the partial last eval batch (301 = 4 x 64 + 45) splits unevenly, and
    the eval loss over each eval batch's global negatives does not depend on the replica count."""
    run = dict(ONE_STEP, train_steps=2, synthetic_test_examples=301)
    _, one = _trained(tmp_path, "one", strategy="mirrored", cpu_replicas=1, **run)
    _, two = _trained(tmp_path, "two", strategy="mirrored", cpu_replicas=2, **run)
    assert np.isfinite(one.eval_metrics["loss"])
    for name in ("loss", "accuracy"):
        assert abs(one.eval_metrics[name] - two.eval_metrics[name]) < 1e-5, name


def test_simclr_with_accumulation_gathers_each_micro_batch(tmp_path):
    """--grad_accum_steps=2 on 2 replicas: the micro-batches run unrolled and each gathers its own
    rows, so the step repeats exactly, and differs from the step without accumulation (an anchor's
    negatives are its micro-batch across replicas, half the global batch)."""
    first, result = _trained(tmp_path, "first", strategy="mirrored", cpu_replicas=2, grad_accum_steps=2, **ONE_STEP)
    again, _ = _trained(tmp_path, "again", strategy="mirrored", cpu_replicas=2, grad_accum_steps=2, **ONE_STEP)
    whole, _ = _trained(tmp_path, "whole", strategy="mirrored", cpu_replicas=2, **ONE_STEP)
    assert np.isfinite(result.train_metrics["loss"])
    assert _max_difference(first, again) == 0.0
    assert _max_difference(first, whole) > 1e-4


@pytest.mark.parametrize(
    "task, flags, expected",
    [
        ("RawAllGatherTask", ["--grad_accum_steps=2"], "inside the micro-batch loop of --grad_accum_steps=2"),
        ("RawMergeCallTask", ["--grad_accum_steps=2"], "inside the micro-batch loop of --grad_accum_steps=2"),
        ("RawAllGatherTask", ["--jit_compile"], "inside the XLA-compiled step (--jit_compile)"),
    ],
)
def test_a_raw_collective_the_step_cannot_hold_is_one_line(tmp_path, task, flags, expected):
    result = run_cli(
        f"--task={TASKS}:{task}",
        "--dataset=synthetic",
        "--synthetic_train_examples=128",
        "--synthetic_test_examples=64",
        "--global_batch=32",
        "--train_steps=1",
        "--model=mlp",
        "--strategy=mirrored",
        "--cpu_replicas=2",
        *flags,
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout and "Traceback" not in result.stderr
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "raw replica-context collective" in errors[0], errors
    assert expected in errors[0] and "self.all_gather" in errors[0]


def test_self_all_gather_under_xla_on_a_mirrored_strategy_is_one_line(tmp_path):
    result = run_cli(
        f"--task={SIMCLR}",
        "--dataset=synthetic",
        "--synthetic_train_examples=128",
        "--synthetic_test_examples=64",
        "--global_batch=32",
        "--train_steps=1",
        "--model=mlp",
        "--strategy=mirrored",
        "--cpu_replicas=2",
        "--jit_compile",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert "error: train_step calls self.all_gather (a collective)" in result.stdout + result.stderr


@pytest.mark.cluster
def test_two_workers_gather_like_one_replica(tmp_path):
    """Two multi_worker_mirrored workers (one replica each) train SimCLR like one replica, and the
    forward pass of their step holds collective gathers and no collective all-reduce."""
    two_workers = tmp_path / "two_workers"
    launched = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        f"--task={TASKS}:GatherOpsSimclrTask",
        "--dataset=synthetic",
        "--synthetic_train_examples=1024",
        "--synthetic_test_examples=300",
        "--global_batch=64",
        "--train_steps=1",
        "--steps_per_loop=1",
        "--seed=7",
        "--model=mlp",
        "--optimizer=sgd",
        "--learning_rate=0.5",
        "--collective_timeout=30",
        "--eval_every=-1",  # training only: an eval_step gather across workers is not supported yet
        f"--model_dir={two_workers}",
        "--export",
        timeout=180,
    )
    assert launched.returncode == 0, launched.stdout[-3000:]
    one, _ = _trained(tmp_path, "one", strategy="mirrored", cpu_replicas=1, **ONE_STEP)
    assert _max_difference(exported_weights(two_workers), one) < 1e-6
    records = glob.glob(str(two_workers / "ops-*.txt"))
    assert len(records) == 2  # each worker traced its step
    for record in records:
        forward = open(record).read().splitlines()
        assert any(line.startswith("CollectiveGather") for line in forward), forward
        assert not any(line.startswith("CollectiveReduce") for line in forward), forward
