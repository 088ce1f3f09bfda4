"""Task.augment_example may return any structure of fixed-shape tensors (two views stacked, a dict,
another size, a label of another dtype): the training batches follow it in every input mode, N
replicas match one, resume is exact; a structure the engine cannot batch is refused at start-up
in one line. The Tasks are in tests/tasks_views.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, checkpoint_state, exported_weights, run_cli, small_config
from engine.config import Config
from engine.controller.trainer import train
from engine.data import builtin, tfrecord
from engine.data.formats import augmented_spec
from engine.errors import UserError
from tasks_views import DictViewsTask, TwoViewsTask

VIEWS_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks_views.py")
IMAGE = tf.TensorSpec((28, 28, 1), tf.float32)
LABEL = tf.TensorSpec((), tf.int32)


def _augment(task_class, seed=3):
    return task_class(small_config("/unused"), input_shape=(28, 28, 1), num_classes=10).example_augmentation(seed)


# ---- the structure augment_example returns ----
def test_the_training_example_follows_what_augment_example_returns():
    assert augmented_spec(_augment(TwoViewsTask), IMAGE, LABEL) == (tf.TensorSpec((2, 28, 28, 1), tf.float32), LABEL)
    assert augmented_spec(_augment(DictViewsTask), IMAGE, LABEL) == {
        "view": IMAGE,
        "small": tf.TensorSpec((14, 14, 1), tf.float32),
        "label": LABEL,
        "weight": tf.TensorSpec((), tf.float32),
    }


@pytest.mark.parametrize(
    "returned, named",
    [
        (lambda x, y, position: (x[: tf.cast(position, tf.int32) % 5 + 1], y), "float32 (None, 28, 1)"),
        (
            lambda x, y, position: (tf.RaggedTensor.from_tensor(x[..., 0], lengths=tf.fill([28], 3)), y),
            "a RaggedTensor",
        ),
        (lambda x, y, position: (x, y, object()), "a Python object"),
        (lambda x, y, position: (x, tf.strings.as_string(y)), "a string tensor where the data held numbers"),
    ],
    ids=["varying_shape", "ragged", "python_object", "string"],
)
def test_a_structure_the_engine_cannot_batch_is_one_line_naming_augment_example(returned, named):
    returned.where = "MyTask.augment_example"
    with pytest.raises(UserError) as refused:
        augmented_spec(returned, IMAGE, LABEL)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("MyTask.augment_example returned (")
    assert named in message and "cannot batch" in message


def test_two_views_in_a_streamed_source_batched_and_record_by_record(tmp_path):
    """TFRecords decoded a batch at a time (augment_each over the batch) and record by record
    (tf.data's map, then batch) give the same two-view batches."""
    images, labels = builtin.synthetic_arrays(64, seed=1, shape=(8, 8, 1))
    for split in ("train", "test"):
        tfrecord.write_shards(str(tmp_path), split, images, labels, 2)
    glob = f"{tmp_path}/train-*,{tmp_path}/test-*"
    batched = tfrecord.load(glob, Config(dataset="tfrecord:x", shuffle_buffer=16))
    one_by_one = tfrecord.load(glob, Config(dataset="tfrecord:x", shuffle_buffer=16))
    one_by_one.decode_batch = None
    augment = _augment(TwoViewsTask)

    def stream(source):
        fn = source.train_dataset_fn(16, seed=4, skip_batches=1, augment=augment)
        return list(fn(tf.distribute.InputContext(1, 0, 1)).take(3))

    for (xa, ya), (xb, yb) in zip(stream(batched), stream(one_by_one), strict=True):
        assert xa.shape == (16, 2, 8, 8, 1) and ya.shape == (16,)
        np.testing.assert_array_equal(xa.numpy(), xb.numpy())
        np.testing.assert_array_equal(ya.numpy(), yb.numpy())
        assert not np.array_equal(xa.numpy()[:, 0], xa.numpy()[:, 1])  # two different views


# ---- training on two views ----
def _views(**overrides):
    return dict(task=f"{VIEWS_TASKS}:TwoViewsTask", model="mlp", optimizer="sgd", **overrides)


def _trained(model_dir, **overrides) -> list:
    train(small_config(model_dir, export=True, **_views(**overrides)), **QUIET)
    return exported_weights(model_dir)


def test_two_views_on_two_replicas_match_one(tmp_path):
    one = _trained(tmp_path / "one", strategy="mirrored", cpu_replicas=1)
    two = _trained(tmp_path / "two", strategy="mirrored", cpu_replicas=2)
    untrained = _trained(tmp_path / "zero", train_steps=1, learning_rate=0.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, untrained)) > 1e-3, "training must move the weights"
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, two, strict=True)) < 1e-5


def test_two_views_resume_exactly(tmp_path):
    """4 steps, then resumed to 8, end bitwise where 8 straight steps end (one replica, deterministic)."""
    config = small_config(tmp_path / "stopped", **_views(train_steps=8, steps_per_loop=2, deterministic=True))
    assert train(config.replace(train_steps=4), **QUIET).final_step == 4
    assert train(config, **QUIET).start_step == 4
    train(config.replace(model_dir=str(tmp_path / "straight")), **QUIET)
    stopped, straight = checkpoint_state(tmp_path / "stopped"), checkpoint_state(tmp_path / "straight")
    assert sorted(stopped) == sorted(straight) and int(stopped["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == 8
    different = [name for name in stopped if not np.array_equal(stopped[name], straight[name])]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"


@pytest.mark.parametrize("input_mode", ["resident", "per_worker"])
def test_a_dict_of_views_trains_in_every_input_mode(tmp_path, input_mode):
    """The dict reaches train_step batched on 2 replicas with 2 micro-batches each; resident
    arrays augment inside the step, per-worker pipelines in tf.data."""
    config = small_config(
        tmp_path,
        task=f"{VIEWS_TASKS}:DictViewsTask",
        model="mlp",
        strategy="mirrored",
        cpu_replicas=2,
        grad_accum_steps=2,
        input_mode=input_mode,
        export=True,
    )
    result = train(config, **QUIET)
    assert result.final_step == 6 and np.isfinite(result.eval_metrics["loss"])
    assert os.path.isdir(tmp_path / "export")


def test_two_views_on_the_command_line_name_the_structure_and_exit_0(tmp_path):
    proc = run_cli(
        f"--task={VIEWS_TASKS}:TwoViewsTask",
        "--dataset=synthetic",
        "--synthetic_train_examples=256",
        "--synthetic_test_examples=64",
        "--global_batch=32",
        "--train_steps=2",
        "--steps_per_loop=2",
        "--strategy=mirrored",
        "--cpu_replicas=2",
        "--model=mlp",
        f"--model_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TwoViewsTask.augment_example gives train_step (float32 (2, 28, 28, 1), int32 ()) per example" in proc.stdout


# ---- refused at start-up ----
def test_a_shape_that_varies_per_example_is_one_line_and_exit_2(tmp_path):
    proc = run_cli(
        f"--task={VIEWS_TASKS}:VaryingCropTask",
        "--dataset=synthetic",
        "--synthetic_train_examples=256",
        "--global_batch=32",
        "--train_steps=2",
        "--model=mlp",
        f"--model_dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "VaryingCropTask.augment_example returned (float32 (None, 28, 1), int32 ())" in lines[0]
    assert not os.path.isdir(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")


@pytest.mark.fast
def test_a_python_object_is_refused_before_training(tmp_path):
    with pytest.raises(UserError, match=r"PythonObjectTask.augment_example returned .*a Python object"):
        train(small_config(tmp_path, task=f"{VIEWS_TASKS}:PythonObjectTask", model="mlp"), **QUIET)


def test_a_parser_that_returns_more_than_the_pair_is_one_line(tmp_path):
    images, labels = builtin.synthetic_arrays(8, seed=1, shape=(8, 8, 1))
    tfrecord.write_shards(str(tmp_path), "train", images, labels, 1)

    def parse_example(serialized):
        parsed = tf.io.parse_single_example(serialized, {"label": tf.io.FixedLenFeature([], tf.int64)})
        return {"label": parsed["label"], "copy": parsed["label"]}, parsed["label"], parsed["label"]

    with pytest.raises(UserError) as refused:
        tfrecord.load(f"{tmp_path}/train-*", Config(dataset="tfrecord:x"), parse_example=parse_example)
    message = str(refused.value)
    assert (
        "\n" not in message
        and "parse_example gives ({'label': int64 (), 'copy': int64 ()}, int64 (), int64 ())" in message
    )
    assert "augment_example" in message
