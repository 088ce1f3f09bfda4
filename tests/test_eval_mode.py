"""Evaluation as its own job: --mode=eval on another strategy, the continuous evaluator (a
TF_CONFIG `evaluator` sidecar beside real workers on 127.0.0.1), its restart, deleted and
half-written checkpoints, and the best checkpoint (model_dir/best/)."""

from __future__ import annotations

import json
import os
import re
import time

import keras
import pytest
import tensorflow as tf

from helpers import (
    QUIET,
    TASKS_FAULTS,
    run_cli,
    small_config,
    small_flags,
    start_cli,
    start_workers,
    tensorboard_scalars,
)
from engine.controller import best as best_lib
from engine.controller.evaluator import evaluate
from engine.controller.trainer import train
from engine.errors import UserError

# small_config(model="mlp", optimizer="adam") as flags; each test says its --train_steps.
ARGS = small_flags(train_steps=None, model="mlp", optimizer="adam")
EVAL_LINE = re.compile(r"eval   step (\d+): loss ([0-9.]+)  accuracy ([0-9.]+)")


def _eval_lines(text) -> dict:
    """{step: (loss, accuracy)} of the console's eval lines (4 decimals)."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in EVAL_LINE.finditer(text)}


def _files(directory) -> dict:
    return {name: os.path.getmtime(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


class _Lines:
    """A console stream that keeps what is written."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def _eval_scalars(model_dir) -> dict:
    """{tag: [(step, value), ...]} of the run's eval/ TensorBoard run (every writer's events)."""
    return tensorboard_scalars(os.path.join(str(model_dir), "eval"))


def test_eval_mode_on_two_replicas_equals_the_training_runs_final_eval(tmp_path):
    """Trained on 1 replica; --mode=eval on 2 mirrored CPU replicas reads the same last checkpoint
    and gets the training run's own final eval metrics, at its step, writing no checkpoint."""
    run = tmp_path / "run"
    trained = train(small_config(run, model="mlp", train_steps=6, eval_every=3), **QUIET)
    before = _files(run / "checkpoints")
    proc = run_cli(*ARGS, "--mode=eval", "--strategy=mirrored", "--cpu_replicas=2", f"--model_dir={run}", timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 replica(s)" in proc.stdout
    printed = _eval_lines(proc.stdout)
    assert list(printed) == [6]
    assert printed[6] == pytest.approx((trained.eval_metrics["loss"], trained.eval_metrics["accuracy"]), abs=1e-4)
    scalars = _eval_scalars(run)
    for name in ("loss", "accuracy"):
        at_six = [value for step, value in scalars[name] if step == 6]
        assert len(at_six) == 2, scalars[name]  # the training run's and the evaluator's
        assert at_six[1] == pytest.approx(at_six[0], rel=1e-5)
    assert _files(run / "checkpoints") == before, "the evaluator wrote into the run's checkpoints/"


@pytest.mark.cluster
def test_sidecar_evaluates_every_checkpoint_once_like_in_training_eval(tmp_path):
    """2 local workers + an evaluator (--evaluator): the workers do not evaluate; the sidecar
    evaluates every checkpoint step exactly once with the numbers a 1-replica run gets when it
    evaluates in training at those steps; --best_metric=loss keeps the lowest."""
    run = tmp_path / "sidecar"
    proc = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--evaluator",
        *ARGS,
        "--train_steps=12",
        "--checkpoint_every=3",
        "--keep_checkpoints=10",
        "--collective_timeout=60",
        "--eval_timeout=120",
        "--best_metric=loss",
        f"--model_dir={run}",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[worker 0] evaluator    TF_CONFIG lists an evaluator task" in proc.stdout
    assert "[evaluator] done         evaluated the run's last step 12" in proc.stdout
    assert not any(line.startswith("[worker") for line in proc.stdout.splitlines() if EVAL_LINE.search(line))
    reference = small_config(tmp_path / "in_training", model="mlp", train_steps=12, eval_every=3, checkpoint_every=3)
    train(reference, **QUIET)
    expected, got = _eval_scalars(tmp_path / "in_training"), _eval_scalars(run)
    for name in ("loss", "accuracy"):
        assert [step for step, _ in got[name]] == [3, 6, 9, 12], got[name]  # each exactly once
        for (step, value), (expected_step, expected_value) in zip(got[name], expected[name]):
            assert step == expected_step and value == pytest.approx(expected_value, abs=1e-4), (name, step)
    with open(run / "eval" / "evaluated.json") as f:
        assert json.load(f)["steps"] == [3, 6, 9, 12]
    best_step, best_loss = min(got["loss"], key=lambda item: item[1])
    record = best_lib.read(str(run))
    assert (record["metric"], record["higher_is_better"], record["step"]) == ("loss", False, best_step)
    assert record["value"] == pytest.approx(best_loss, rel=1e-6)


UNBUFFERED = {"PYTHONUNBUFFERED": "1"}  # each line arrives as it is written


@pytest.mark.cluster
def test_killed_evaluator_does_not_disturb_training_and_a_restarted_one_continues(tmp_path):
    """The sidecar is killed (SIGKILL) after its first evaluation while the workers train: they
    finish with exit 0. A restarted evaluator skips the steps already evaluated and evaluates the
    rest, so every checkpoint step is evaluated exactly once."""
    run = tmp_path / "run"
    args = [
        *ARGS,
        f"--task={TASKS_FAULTS}:SlowTrainingTask",
        "--train_steps=72",
        "--checkpoint_every=12",
        "--keep_checkpoints=10",
        "--collective_timeout=60",
        "--eval_timeout=120",
        f"--model_dir={run}",
    ]
    with start_workers(args, evaluator=True, env=UNBUFFERED) as cluster:
        workers, evaluator = cluster.processes[:2], cluster[2]
        cluster.wait_for_line(2, r"eval   step \d+", timeout=240)
        assert all(w.poll() is None for w in workers), "training ended before the evaluator could be killed"
        evaluator.kill()
        for worker in workers:
            assert worker.wait(timeout=300) == 0, cluster.outputs[0][-3000:] + cluster.outputs[1][-3000:]
    assert "done   training" in cluster[0].output
    first = _eval_lines(evaluator.output)
    assert first and max(first) < 72
    restarted = run_cli(
        "--strategy=multi_worker_mirrored", *args, env={"TF_CONFIG": cluster.tf_configs[2]}, timeout=180
    )
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-2000:]
    second = _eval_lines(restarted.stdout)
    assert not set(first) & set(second), (first, second)
    assert sorted({*first, *second}) == [12, 24, 36, 48, 60, 72]
    assert [step for step, _ in _eval_scalars(run)["accuracy"]] == [12, 24, 36, 48, 60, 72]


def test_evaluator_waits_for_training_skips_deleted_and_unlisted_checkpoints(tmp_path):
    """Started before training (no model_dir yet), a continuous evaluator waits, then evaluates each
    checkpoint; a checkpoint deleted before it is read is skipped with a warning, and files the
    `checkpoint` state does not list (a half-written save) are never read."""
    run = tmp_path / "run"
    evaluator_args = [*ARGS, "--mode=continuous_eval", "--train_steps=6", "--eval_timeout=120", f"--model_dir={run}"]
    with start_cli(*evaluator_args, env=UNBUFFERED) as waiting:
        waiting.wait_for_line("waiting      for .*config.json", timeout=120)
        trained = train(small_config(run, model="mlp", train_steps=6, checkpoint_every=3, eval_every=-1), **QUIET)
        waiting.wait(timeout=180)
    output = waiting.output
    assert waiting.returncode == 0, output[-3000:]
    assert sorted(_eval_lines(output)) == [3, 6]
    assert not trained.eval_metrics  # --eval_every=-1: no evaluation in training, not even the last

    # A second run of the same model_dir: ckpt-6 deleted (still listed), ckpt-9 files not listed.
    os.remove(run / "eval" / "evaluated.json")
    for name in os.listdir(run / "checkpoints"):
        if name.startswith("ckpt-6."):
            os.remove(run / "checkpoints" / name)
    for suffix in (".index", ".data-00000-of-00001"):
        (run / "checkpoints" / f"ckpt-9{suffix}").write_bytes(b"half written")
    out = _Lines()
    config = small_config(run, model="mlp", mode="continuous_eval", eval_timeout=3, strategy="mirrored", cpu_replicas=2)
    result = evaluate(config, out=out)
    text = out.text
    assert list(result.evaluated) == [3]
    assert [os.path.basename(p) for p in result.skipped] == ["ckpt-6"]
    assert "warning      checkpoint" in text and "ckpt-6 was deleted" in text
    assert "ckpt-9" not in text


def test_best_checkpoint_follows_the_metric_in_training(tmp_path):
    """The chief keeps model_dir/best/ at the step with the highest eval accuracy: best.json, a
    checkpoint of that step, and the exported model."""
    run = tmp_path / "run"
    train(
        small_config(run, model="mlp", train_steps=12, eval_every=2, best_metric="accuracy", learning_rate=0.01),
        **QUIET,
    )
    accuracy = _eval_scalars(run)["accuracy"]
    assert len({value for _, value in accuracy}) > 1, accuracy  # the metric moved, so the choice matters
    best_value = max(value for _, value in accuracy)
    best_step = next(step for step, value in accuracy if value == best_value)  # the first one: ties keep it
    record = best_lib.read(str(run))
    assert (record["metric"], record["higher_is_better"], record["step"]) == ("accuracy", True, best_step)
    assert record["value"] == pytest.approx(best_value, rel=1e-6)
    reader = tf.train.load_checkpoint(record["checkpoint"])
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == best_step
    keras.models.load_model(run / "best" / "model.keras")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("accuracy", ("accuracy", True)),
        ("loss", ("loss", False)),
        ("-loss", ("loss", False)),
        ("+loss", ("loss", True)),
        ("-accuracy", ("accuracy", False)),
    ],
)
def test_best_metric_directions(spec, expected):
    assert best_lib.parse_best_metric(spec) == expected


@pytest.mark.fast
def test_best_metric_must_be_an_eval_metric(tmp_path):
    with pytest.raises(UserError, match="eval metrics are loss, accuracy; there is no 'top5'"):
        best_lib.BestKeeper(str(tmp_path), "+top5", metric_names=("loss", "accuracy"))


def test_continuous_eval_knows_an_epoch_runs_last_step(tmp_path):
    """A run of --epochs (no --train_steps): the evaluator takes the last step from config.json's
    epochs and the data's steps per epoch at the run's global batch (1024 / 64 = 16), and stops there
    at once, not after --eval_timeout."""
    run = tmp_path / "run"
    train(small_config(run, model="mlp", train_steps=0, epochs=1, checkpoint_every=8, eval_every=-1), **QUIET)
    out = _Lines()
    started = time.monotonic()
    # Another global batch for evaluation; steps per epoch still come from the run's.
    result = evaluate(
        small_config(run, model="mlp", mode="continuous_eval", eval_timeout=60, global_batch=100), out=out
    )
    assert list(result.evaluated) == [8, 16]
    assert "done         evaluated the run's last step 16" in out.text
    assert time.monotonic() - started < 30


@pytest.mark.cluster
def test_best_checkpoint_kept_by_the_chief_of_two_workers(tmp_path):
    """Evaluating in training on 2 workers, every worker takes part in the best-checkpoint save
    (none hangs) and the chief's model_dir/best follows --best_metric=-loss (the signed form)."""
    run = tmp_path / "run"
    proc = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        *ARGS,
        "--train_steps=12",
        "--eval_every=3",
        "--collective_timeout=60",
        "--best_metric=-loss",
        f"--model_dir={run}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    loss = _eval_scalars(run)["loss"]
    assert [step for step, _ in loss] == [3, 6, 9, 12]
    best_step, best_loss = min(loss, key=lambda item: item[1])
    record = best_lib.read(str(run))
    assert (record["metric"], record["higher_is_better"], record["step"]) == ("loss", False, best_step)
    assert record["value"] == pytest.approx(best_loss, rel=1e-6)
    assert (
        tf.train.load_checkpoint(record["checkpoint"]).get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == best_step
    )
