"""Features compose: every pair of feature-flag values trains together in one short run (a covering
array, built greedily below), and a refused combination ends with exit 2 and one `error:` line.
Where a combination works it is also correct: accumulation with synchronised batch norm equals one
replica fed the same micro-batches, and XLA equals the same run without it.

To cover a new flag, append a (name, {label: flag arguments}) row to FEATURES."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import (
    NO_DROPOUT,
    QUIET,
    TASKS_COLLECT,
    TASKS_STATE,
    explain,
    exported_weights,
    max_difference,
    run_cli,
    run_in_process,
    small_config,
)
from engine.controller.state import create_state
from engine.controller.trainer import train
from engine.data.builtin import synthetic_arrays
from engine.distribute.strategy import build_strategy
from engine.loop import LoopOptions, make_train_loop
from engine.randomness import per_replica_randomness
from tasks_equivalence import CnnBnNoDropoutTask

# Data files the `data` feature reads, written by the `cli_runs` fixture before any run starts.
DATA_DIR = os.path.join(tempfile.gettempdir(), f"ctl_combinations_{os.getpid()}")

TFRECORDS = (f"--dataset=tfrecord:{DATA_DIR}/rec/train-*,{DATA_DIR}/rec/test-*", "--shuffle_buffer=32")

FEATURES = (
    # --cache acts on streamed data only (refused elsewhere), so it is a kind of data here
    (
        "data",
        {
            "synthetic": (),
            "npz": (f"--dataset=npz:{DATA_DIR}/d.npz",),
            "tfrecord": TFRECORDS,
            "tfrecord_cache": TFRECORDS + ("--cache",),
        },
    ),
    (
        "strategy",
        {
            "default": (),
            "mirrored1": ("--strategy=mirrored", "--cpu_replicas=1"),
            "mirrored2": ("--strategy=mirrored", "--cpu_replicas=2"),
        },
    ),
    ("model", {"cnn": ("--model=cnn",), "cnn_bn": ("--model=cnn_bn",), "mlp": ("--model=mlp",)}),
    ("precision", {p: (f"--precision={p}",) for p in ("float32", "mixed_bfloat16", "mixed_float16")}),
    ("accum", {"accum1": ("--grad_accum_steps=1",), "accum2": ("--grad_accum_steps=2",)}),
    (
        "task",
        {
            "classification": ("--task=classification",),
            "label_smoothing": ("--task=label_smoothing",),
            # two models, two optimizers through the engine's one update path (issue 23)
            "two_optimizers": (f"--task={TASKS_STATE}:ProbeTask",),
            # self.all_gather and self.micro_batch in train_step, Task.after_update, self.collect in
            # eval_step, Task.eval_summary (issue 45)
            "gather_collect": (f"--task={TASKS_COLLECT}:GatherCollectTask",),
        },
    ),
    (
        "on_nonfinite",
        {
            "stop": ("--on_nonfinite=stop",),
            "skip": ("--on_nonfinite=skip",),
            "rollback": ("--on_nonfinite=rollback", "--max_rollbacks=2"),
        },
    ),
    ("loss_bound", {"unbounded": (), "bounded": ("--loss_upper_bound=100",)}),
    ("preflight", {"preflight": (), "nopreflight": ("--nopreflight",)}),
    ("ema", {"no_ema": (), "ema": ("--ema_decay=0.9",)}),
    ("early_stopping", {"no_early_stop": (), "early_stop": ("--early_stopping_patience=1", "--best_metric=accuracy")}),
    ("stall_watch", {"watched": ("--stall_timeout=600",), "unwatched": ("--stall_timeout=0",)}),
    (
        "optimizer",
        {
            "plain": (),
            "decay_warmup": ("--weight_decay=0.01", "--lr_schedule=warmup_cosine", "--warmup_steps=1"),
            "clip_cosine": ("--clip_norm=1.0", "--lr_schedule=cosine"),
        },
    ),
    ("xla", {"nojit": ("--nojit_compile",), "jit": ("--jit_compile",)}),
    ("eager", {"compiled": (), "eager": ("--run_eagerly",)}),
    ("summaries", {"basic": ("--summaries=basic",), "full": ("--summaries=full", "--histogram_every=2")}),
    ("best", {"last": (), "best_accuracy": ("--best_metric=accuracy",)}),
    ("input", {"auto": (), "pipeline": ("--input_mode=distribute_dataset",), "resident": ("--input_mode=resident",)}),
)
SHORT_RUN = (
    "--dataset=synthetic",
    "--synthetic_train_examples=64",
    "--synthetic_test_examples=32",
    "--global_batch=16",
    "--train_steps=2",
    "--steps_per_loop=2",
    "--seed=1",
    "--noexport",
)


def refused(row: dict) -> bool:
    """The combinations the engine refuses (docs/failures.md, engine/refused_combinations.py).
    `row` may be partial: True once the values it holds are refused whatever the others are."""
    return (
        (row.get("xla") == "jit" and row.get("model") == "cnn_bn" and row.get("strategy", "").startswith("mirrored"))
        or (row.get("loss_bound") == "bounded" and row.get("on_nonfinite") == "skip")
        or (row.get("data") == "tfrecord_cache" and row.get("input") == "resident")
        or (row.get("eager") == "eager" and row.get("xla") == "jit")
    )


def _pairs(row: dict) -> set:
    return {((f, row[f]), (g, row[g])) for f, g in itertools.combinations(row, 2)}


def all_pairs(features=FEATURES) -> set:
    return {((f, a), (g, b)) for (f, fv), (g, gv) in itertools.combinations(features, 2) for a in fv for b in gv}


def covering_rows(features=FEATURES, excluded=refused) -> list[dict]:
    """Greedy pairwise covering array. Each row starts from the first uncovered pair (in the order
    features and values are listed); every other feature then takes the value covering the most
    uncovered pairs with the values already in the row (ties: the first listed) among those that do
    not make the row `excluded`. Pairs only an excluded row could hold are left out."""
    order = {(name, value): (i, j) for i, (name, values) in enumerate(features) for j, value in enumerate(values)}
    uncovered = {pair for pair in all_pairs(features) if not excluded(dict(pair))}
    rows = []
    while uncovered:
        row = dict(min(uncovered, key=lambda pair: (order[pair[0]], order[pair[1]])))
        for name, values in features:
            if name not in row:
                choices = [v for v in values if not excluded({**row, name: v})]
                assert choices, f"no value of {name} completes {row} without a refused combination"
                row[name] = max(choices, key=lambda v: len(_pairs({**row, name: v}) & uncovered))
        row = {name: row[name] for name, _ in features}
        uncovered -= _pairs(row)
        rows.append(row)
    return rows


def write_data_files(directory=DATA_DIR) -> None:
    """The same 64 train / 32 test 28x28 grey images as the synthetic source, as an npz and TFRecords."""
    from engine.data import tfrecord

    (x, y), (xt, yt) = synthetic_arrays(64, seed=1), synthetic_arrays(32, seed=2)
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, "d.npz"), x_train=x, y_train=y, x_test=xt, y_test=yt)
    tfrecord.write_shards(os.path.join(directory, "rec"), "train", x, y, 2)
    tfrecord.write_shards(os.path.join(directory, "rec"), "test", xt, yt, 2)


def _args(row: dict) -> list:
    values = dict(FEATURES)
    return [arg for name, label in row.items() for arg in values[name][label]]


ROWS = covering_rows()
# Beyond pairs: the triple issue 16 reported (it crashed in the batch norm's all-reduce).
TRAINED_ROWS = ROWS + [dict(ROWS[0], strategy="mirrored2", model="cnn_bn", accum="accum2")]
REFUSED_ROWS = [dict(ROWS[0], strategy=s, model="cnn_bn", xla="jit") for s in ("mirrored1", "mirrored2")] + [
    dict(ROWS[0], loss_bound="bounded", on_nonfinite="skip", xla="nojit"),
    dict(ROWS[0], data="tfrecord_cache", input="resident"),
    dict(ROWS[0], eager="eager", xla="jit"),
]


@pytest.mark.fast
def test_the_rows_cover_every_pair_and_run_nothing_refused():
    covered = set().union(*(_pairs(row) for row in ROWS))
    allowed = {pair for pair in all_pairs() if not refused(dict(pair))}
    assert covered == allowed, sorted(allowed - covered)
    assert not any(refused(row) for row in ROWS)
    assert all(refused(row) for row in REFUSED_ROWS)
    assert len(ROWS) <= 24  # a short suite: the greedy array stays near the 9 rows 3 x 3 values need


def _row_id(row: dict) -> str:
    return "-".join(row.values())


@pytest.fixture(scope="module")
def cli_runs(request, tmp_path_factory):
    """{row id: future of its run.py process} for the trained rows selected in this session, two at
    a time (much of a short run is single-threaded start-up and tracing); the data files every row reads."""
    rows = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "row" in params and not refused(params["row"]):
            rows[_row_id(params["row"])] = params["row"]
    write_data_files()
    # Made here, not in the pool's threads: two threads creating pytest's first temporary directory
    # of the process at once race (one gets FileExistsError).
    model_dirs = {row_id: str(tmp_path_factory.mktemp("run") / "run") for row_id in rows}
    pool = ThreadPoolExecutor(max_workers=2)
    yield {
        row_id: pool.submit(
            lambda row, model_dir: run_cli(*SHORT_RUN, *_args(row), "--model_dir=" + model_dir, timeout=300),
            row,
            model_dirs[row_id],
        )
        for row_id, row in rows.items()
    }
    pool.shutdown(cancel_futures=True)
    shutil.rmtree(DATA_DIR, ignore_errors=True)


@pytest.mark.parametrize("row", TRAINED_ROWS, ids=map(_row_id, TRAINED_ROWS))
def test_pairwise_combination_trains(row, cli_runs):
    proc = cli_runs[_row_id(row)].result()
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr
    assert any(line.startswith("done") for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.parametrize("row", REFUSED_ROWS, ids=map(_row_id, REFUSED_ROWS))
@pytest.mark.fast
def test_refused_combination_says_so_in_one_line(row, cli_runs, tmp_path):
    # In this process (run.py's main): a refusal stops before training, no start-up worth a process.
    proc = run_in_process(*SHORT_RUN, *_args(row), f"--model_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], explain(proc)
    assert "Traceback" not in proc.stderr
    if row["loss_bound"] == "bounded":
        expected = ("--loss_upper_bound", "--on_nonfinite=skip")
    elif row["data"] == "tfrecord_cache":
        expected = ("--cache", "--input_mode=resident")
    elif row["eager"] == "eager":
        expected = ("--run_eagerly", "--jit_compile")
    else:
        expected = ("--jit_compile", "--strategy=mirrored", "cnn_bn")
    assert all(part in errors[0] for part in expected), errors[0]
    assert not any(line.startswith("done") for line in proc.stdout.splitlines())  # refused, not trained


# ---- where a combination works, it is correct ----


def _synthetic_batches(steps, batch):
    images, labels = synthetic_arrays(steps * batch, seed=4)
    return (images[..., None] / 255.0).astype(np.float32), labels.astype(np.int32)


def _train_on(tmp_path, name, replicas, images, labels, accum):
    """cnn_bn (no dropout, BN momentum 0.5), SGD, one step per batch of 64 given, through the
    engine's loop; returns {weight path: value} and each replica's copy of the moving statistics."""
    keras.utils.set_random_seed(5)
    strategy = build_strategy("mirrored" if replicas > 1 else "default", replicas).strategy
    task = CnnBnNoDropoutTask(
        small_config(tmp_path / name, model="cnn_bn", optimizer="sgd", grad_accum_steps=accum),
        input_shape=(28, 28, 1),
        num_classes=10,
    )
    task.total_steps = len(images) // 64
    state = create_state(strategy, task, seed=5, model_dir=str(tmp_path / name), is_chief=True, keep=1)
    loop = make_train_loop(strategy, task, state.global_step, LoopOptions(accum_steps=accum))
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((images, labels)).batch(64))
    result = loop(iter(dataset), tf.constant(task.total_steps))
    assert int(result["steps"]) == task.total_steps
    weights = {w.path: np.asarray(w.numpy()) for w in task.model.weights}
    copies = [
        np.asarray(c.numpy()) for w in task.model.non_trainable_weights for c in getattr(w.value, "values", [w.value])
    ]
    return weights, copies


def test_accumulation_with_synchronised_batch_norm_equals_one_replica_fed_the_same_micro_batches(tmp_path):
    """2 replicas x 2 micro-batches of 16: micro-batch i is normalised by the statistics of the i-th
    slice of EVERY replica (the global micro-batch of 32), and moves the moving statistics once.
    One replica accumulating 2 micro-batches, whose batches are reordered so that its micro-batch i
    holds those same 32 examples, must end with the same weights and moving statistics."""
    images, labels = _synthetic_batches(2, 64)
    # Replica r gets examples 32r..32r+31 of a batch, and its micro-batch i is 16 of them.
    order = np.concatenate([step * 64 + np.r_[0:16, 32:48, 16:32, 48:64] for step in range(2)])
    two, two_copies = _train_on(tmp_path, "two", 2, images, labels, accum=2)
    same_micro_batches, _ = _train_on(tmp_path, "one", 1, images[order], labels[order], accum=2)
    # Summation order differs; a max-pool near-tie or a pre-ReLU value near 0 can then route a
    # gradient elsewhere (measured: up to 1e-4 on some random inputs, 3e-6 on these).
    assert max_difference(two, same_micro_batches) < 2e-5
    for copy, other in zip(two_copies[::2], two_copies[1::2]):  # both replicas hold the same statistics
        np.testing.assert_allclose(copy, other, rtol=1e-6)
    # Per micro-batch, not per step or per replica slice: other groupings move them differently.
    whole_batch, _ = _train_on(tmp_path, "whole", 1, images, labels, accum=1)
    other_micro_batches, _ = _train_on(tmp_path, "other", 1, images, labels, accum=2)
    assert max_difference(two, whole_batch, moving_only=True) > 1e-3
    assert max_difference(two, other_micro_batches, moving_only=True) > 1e-3


XLA_CASES = {
    # Seed 8: on some batches (seed 7's first) a max-pool tie or a pre-ReLU value at 0 routes the
    # gradient differently under XLA, and batch norm amplifies it (2e-4 after one step, measured).
    "cnn_bn-accum2-default": dict(task=NO_DROPOUT, grad_accum_steps=2, seed=8),  # unrolled micro-batches
    "cnn-accum2-mirrored2": dict(model="cnn", grad_accum_steps=2, strategy="mirrored", cpu_replicas=2),
}
# Not compared: random layers. XLA implements TensorFlow's stateless random ops differently, so a
# Dropout mask under XLA is another mask than without it (measured: even on one device).


@pytest.mark.parametrize("case", XLA_CASES.values(), ids=XLA_CASES.keys())
def test_xla_equals_the_same_run_without_it(tmp_path, case):
    """Each replica's step compiled with XLA trains like the same run without it: weights (batch-norm
    statistics included) and the reported loss, within float tolerance."""
    settings = {**dict(model="cnn_bn", optimizer="sgd", train_steps=2, steps_per_loop=2, export=True), **case}
    plain = train(small_config(tmp_path / "plain", **settings), **QUIET)
    xla = train(small_config(tmp_path / "xla", jit_compile=True, **settings), **QUIET)
    plain_weights, xla_weights = exported_weights(tmp_path / "plain"), exported_weights(tmp_path / "xla")
    assert len(plain_weights) == len(xla_weights)
    for a, b in zip(plain_weights, xla_weights):
        np.testing.assert_allclose(b, a, atol=1e-4)
    assert abs(xla.train_metrics["loss"] - plain.train_metrics["loss"]) < 1e-4


@pytest.mark.fast
def test_xla_dropout_draws_its_own_mask_on_each_replica():
    """Dropout inside the XLA-compiled replica step, on 2 logical CPU devices (the engine's wrapped
    seed generators): it runs, and each replica draws its own mask."""
    strategy = build_strategy("mirrored", 2).strategy
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)])
    per_replica_randomness(model)
    step = tf.function(lambda x: model(x, training=True), jit_compile=True)
    masks = strategy.experimental_local_results(tf.function(lambda: strategy.run(lambda: step(tf.ones([1, 64]))))())
    first, second = (np.asarray(mask) > 0 for mask in masks)
    assert 10 < first.sum() < 54 and 10 < second.sum() < 54  # about half kept on each
    assert (first != second).any()
