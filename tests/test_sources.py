"""Data sources: npz of any shape, synthetic shapes, TFRecord streams (schema, sharding, eval once,
resume; image folders' resume too), augmentation seeds, and the sources' bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, TASKS_DATA, checkpoint_state, id_arrays, id_shards, small_config, stream_eval_totals
from tasks_data import FlipTask
from engine.config import Config
from engine.controller.trainer import train
from engine.data import builtin, sources, tfrecord
from engine.errors import UserError
from engine.task import Task


def write_npz(path, x_train, y_train, x_test, y_test):
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return str(path)


# ---- in-memory sources ----
def test_npz_any_shape_and_dtype(tmp_path):
    rng = np.random.default_rng(0)
    colour = write_npz(
        tmp_path / "c.npz",
        rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8),
        rng.integers(0, 5, 20),
        rng.integers(0, 256, (7, 8, 8, 3), dtype=np.uint8),
        rng.integers(0, 5, 7),
    )
    source = sources.load(Config(dataset=f"npz:{colour}"))
    assert source.spec.input_shape == (8, 8, 3) and source.spec.features.dtype == tf.float32
    assert source.spec.num_classes == 5 and source.spec.is_image
    x, _ = next(iter(source.eval_dataset(4)))
    assert float(tf.reduce_max(x)) <= 1.0  # images normalised to [0, 1]

    tokens = write_npz(
        tmp_path / "t.npz",
        rng.integers(0, 300, (20, 16), dtype=np.int64),
        rng.integers(0, 2, 20),
        rng.integers(0, 300, (5, 16), dtype=np.int64),
        rng.integers(0, 2, 5),
    )
    source = sources.load(Config(dataset=f"npz:{tokens}"))
    assert source.spec.features.dtype == tf.int32 and source.spec.input_shape == (16,)
    assert not source.spec.is_image

    regression = write_npz(tmp_path / "r.npz", rng.random((20, 3)), rng.random(20), rng.random((5, 3)), rng.random(5))
    source = sources.load(Config(dataset=f"npz:{regression}"))
    assert source.spec.labels.dtype == tf.float32 and source.spec.num_classes is None


def test_synthetic_shape_and_classes():
    source = sources.load(
        Config(
            dataset="synthetic",
            synthetic_shape="32,32,3",
            num_classes=4,
            synthetic_train_examples=64,
            synthetic_test_examples=8,
        )
    )
    assert source.spec.input_shape == (32, 32, 3) and source.spec.num_classes == 4
    assert source.y_train.max() < 4
    vectors = sources.load(
        Config(dataset="synthetic", synthetic_shape="64", synthetic_train_examples=64, synthetic_test_examples=8)
    )
    assert vectors.spec.input_shape == (64,)


def test_colour_npz_trains_end_to_end(tmp_path):
    x, y = builtin.synthetic_arrays(512, seed=1, shape=(16, 16, 3))
    xt, yt = builtin.synthetic_arrays(101, seed=2, shape=(16, 16, 3))
    path = write_npz(tmp_path / "c.npz", x, y, xt, yt)
    result = train(small_config(tmp_path / "run", dataset=f"npz:{path}", train_steps=4, steps_per_loop=2), **QUIET)
    assert result.final_step == 4 and np.isfinite(result.eval_metrics["loss"])


# ---- TFRecord streams ----
def test_tfrecord_default_schema_round_trip(tmp_path):
    images, labels = builtin.synthetic_arrays(30, seed=1, shape=(8, 8, 3))
    tfrecord.write_shards(str(tmp_path), "train", images, labels, 3)
    source = tfrecord.load(f"{tmp_path}/train-*.tfrecord", Config(dataset="tfrecord:x"))
    assert source.num_train == 30 and source.num_test == 30 and source.spec.num_classes == int(labels.max()) + 1
    x, y = next(source.test_batches(100))
    # Shards are dealt round-robin and read interleaved, one record of each in turn: the original order.
    np.testing.assert_allclose(x, images / 255.0, atol=1e-6)
    np.testing.assert_array_equal(y, labels)


@pytest.mark.parametrize("shards, policy", [(4, "FILE"), (1, "DATA")])
def test_two_workers_read_disjoint_examples(tmp_path, shards, policy):
    dataset = id_shards(tmp_path, n_train=200, shards=shards)
    source = sources.load(Config(dataset=dataset, shuffle_buffer=50))
    assert policy in source.sharding(2)
    per_worker = []
    for pipeline in range(2):  # one epoch of each worker's share: 100 examples, 10 per batch
        context = tf.distribute.InputContext(2, pipeline, 2)
        batches = source.train_dataset_fn(40, seed=3)(context).take(10)
        per_worker.append(np.concatenate([x.numpy()[:, 0] for x, _ in batches]).astype(np.int64))
    assert not set(per_worker[0]) & set(per_worker[1])
    assert len(set(per_worker[0]) | set(per_worker[1])) == 200


@pytest.mark.parametrize("replicas", [1, 2])
def test_stream_eval_covers_every_example_once(tmp_path, replicas):
    source = sources.load(Config(dataset=id_shards(tmp_path, n_test=1001)))
    assert stream_eval_totals(source, replicas, 64) == (1001, sum(range(1000, 2001)))


def test_stream_resume_skips_exactly(tmp_path):
    source = sources.load(Config(dataset=id_shards(tmp_path, n_train=100), shuffle_buffer=30))
    context = tf.distribute.InputContext(1, 0, 1)
    straight = [x.numpy()[:, 0] for x, _ in source.train_dataset_fn(16, seed=5)(context).take(15)]
    resumed = [x.numpy()[:, 0] for x, _ in source.train_dataset_fn(16, seed=5, skip_batches=9)(context).take(6)]
    np.testing.assert_array_equal(np.concatenate(straight[9:]), np.concatenate(resumed))
    epoch1 = np.concatenate(straight)[:96]
    assert len(set(epoch1.astype(int))) == 96  # no example twice within an epoch (100 examples)


def write_png_folders(directory, split, x, y):
    """x (N, H, W, 1|3) uint8 as directory/split/<label>/<i>.png (labels 0-9 sort as their folders)."""
    for i, (image, label) in enumerate(zip(x, y)):
        os.makedirs(os.path.join(directory, split, str(label)), exist_ok=True)
        tf.io.write_file(os.path.join(directory, split, str(label), f"{i:05d}.png"), tf.io.encode_png(image))


def dataset_of_kind(tmp_path, kind) -> str:
    """The same 640 train / 64 test 12x12 grey images as an npz, TFRecords or PNG folders."""
    x, y = builtin.synthetic_arrays(640, seed=1, shape=(12, 12, 1))
    xt, yt = builtin.synthetic_arrays(64, seed=2, shape=(12, 12, 1))
    if kind == "npz":
        return "npz:" + write_npz(tmp_path / "d.npz", x, y, xt, yt)
    if kind == "tfrecord":
        tfrecord.write_shards(str(tmp_path / "rec"), "train", x, y, 3)
        tfrecord.write_shards(str(tmp_path / "rec"), "test", xt, yt, 2)
        return f"tfrecord:{tmp_path}/rec/train-*,{tmp_path}/rec/test-*"
    write_png_folders(str(tmp_path / "img"), "train", x, y)
    write_png_folders(str(tmp_path / "img"), "test", xt, yt)
    return f"images:{tmp_path}/img"


def _stopped_and_straight(tmp_path, kind, **overrides):
    """A run stopped at step 7 and resumed to 16 (with `overrides`), and one straight to 16 on one
    replica: their final checkpoints."""
    config = small_config(
        tmp_path / "stopped",
        dataset=dataset_of_kind(tmp_path, kind),
        train_steps=16,
        shuffle_buffer=100,
        deterministic=True,
    )
    train(config.replace(train_steps=7, **overrides), **QUIET)
    assert train(config.replace(**overrides), **QUIET).start_step == 7
    train(config.replace(model_dir=str(tmp_path / "straight"), strategy="default"), **QUIET)
    stopped, straight = checkpoint_state(tmp_path / "stopped"), checkpoint_state(tmp_path / "straight")
    assert sorted(stopped) == sorted(straight)
    return stopped, straight


@pytest.mark.parametrize("kind", ["npz", "tfrecord", "images"])
def test_resume_is_bitwise_on_one_deterministic_replica(tmp_path, kind):
    stopped, straight = _stopped_and_straight(tmp_path, kind, strategy="default")
    assert all(np.array_equal(stopped[k], straight[k]) for k in stopped)


@pytest.mark.parametrize("kind", ["tfrecord", "images"])
def test_two_replicas_resumed_match_one_replica_straight(tmp_path, kind):
    """A stream on 2 replicas (consecutive per-replica batches = one global batch), stopped and
    resumed, ends where one replica fed the same global batches ends."""
    stopped, straight = _stopped_and_straight(tmp_path, kind, strategy="mirrored", cpu_replicas=2)
    for name in stopped:
        np.testing.assert_allclose(stopped[name], straight[name], rtol=1e-4, atol=1e-5, err_msg=name)


# ---- augmentation ----
def test_augmentation_seeds_differ_per_example_and_epoch_and_repeat(tmp_path):
    source = sources.load(Config(dataset=id_shards(tmp_path, n_train=64), shuffle_buffer=10))
    task = FlipTask(small_config("/unused"), spec=source.spec)
    context = tf.distribute.InputContext(1, 0, 1)

    def signs(seed):
        fn = source.train_dataset_fn(32, seed, augment=task.example_augmentation(seed))
        return np.concatenate([np.sign(x.numpy()[:, 1]) for x, _ in fn(context).take(4)])

    first = signs(1)
    assert 0.2 < (first < 0).mean() < 0.8  # some examples flipped, some not
    np.testing.assert_array_equal(first, signs(1))  # repeats with the seed
    assert not np.array_equal(first, signs(2))
    assert Task(small_config("/unused"), spec=source.spec).example_augmentation(1) is None  # no hook: no map


@pytest.mark.parametrize("png", [True, False], ids=["png", "serialized_tensors"])
def test_tfrecords_decoded_a_batch_at_a_time_match_record_by_record(tmp_path, png):
    """The default schema decodes whole batches (one parse_example); its training batches (with a
    Task's augmentation and 2 workers' shares) and eval batches equal decoding record by record."""
    images, labels = builtin.synthetic_arrays(96, seed=1, shape=(8, 8, 3))
    for split in ("train", "test"):
        tfrecord.write_shards(str(tmp_path), split, images, labels, 3, png=png)
    batched = tfrecord.load(f"{tmp_path}/train-*,{tmp_path}/test-*", Config(dataset="tfrecord:x", shuffle_buffer=20))
    assert batched.decode_batch is not None
    one_by_one = tfrecord.load(f"{tmp_path}/train-*,{tmp_path}/test-*", Config(dataset="tfrecord:x", shuffle_buffer=20))
    one_by_one.decode_batch = None
    augment = FlipTask(small_config("/unused"), spec=batched.spec).example_augmentation(4)

    def stream(source, pipeline):
        fn = source.train_dataset_fn(32, seed=4, skip_batches=1, augment=augment)
        return list(fn(tf.distribute.InputContext(2, pipeline, 2)).take(5))

    for pipeline in range(2):
        for (xa, ya), (xb, yb) in zip(stream(batched, pipeline), stream(one_by_one, pipeline), strict=True):
            np.testing.assert_array_equal(xa.numpy(), xb.numpy())
            np.testing.assert_array_equal(ya.numpy(), yb.numpy())
    for (xa, ya), (xb, yb) in zip(batched.test_batches(40), one_by_one.test_batches(40), strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def test_tfrecord_serialized_tensor_of_another_shape_is_named(tmp_path):
    images, labels = builtin.synthetic_arrays(4, seed=1, shape=(8, 8, 3))
    others, _ = builtin.synthetic_arrays(4, seed=1, shape=(8, 8, 4))
    first = tfrecord.write_shards(str(tmp_path / "a"), "train", images, labels, 1, png=False)[0]
    second = tfrecord.write_shards(str(tmp_path / "b"), "train", others, labels, 1, png=False)[0]
    source = tfrecord.load(f"{first},{second}", Config(dataset="tfrecord:x"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="is not a uint8 tensor of shape \\[8, 8, 3\\]"):
        list(source.test_batches(4))


# ---- bad input: one clear error each ----
def _bad_npz(tmp_path):
    return "npz:" + write_npz(
        tmp_path / "b.npz", np.zeros((4, 3)), np.zeros(4, np.int64), np.zeros((2, 5)), np.zeros(2, np.int64)
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: "tfrecord:" + str(p / "nothing-*.tfrecord"), "matches no file"),
        (lambda p: "npz:" + str(p / "missing.npz"), "no such file"),
        (lambda p: "npz:" + write_npz(p / "k.npz", np.zeros((4, 3)), np.zeros(4), np.zeros((2, 3)), np.zeros(2)), None),
        (_bad_npz, r"test features are \(5,\), train features \(3,\)"),
        (
            lambda p: (
                "npz:"
                + write_npz(
                    p / "l.npz", np.zeros((4, 3)), np.array([0, 1, 2, 12]), np.zeros((2, 3)), np.zeros(2, np.int64)
                )
            ),
            r"labels range over \[0, 12\]",
        ),
        (lambda p: "parquet:x", "expected one of"),
        (lambda p: "imagenet", "unknown --dataset"),
    ],
    ids=["glob", "npz_missing", "npz_ok", "shapes", "labels", "kind", "name"],
)
def test_bad_sources_are_one_line_errors(tmp_path, make, message):
    dataset = make(tmp_path)
    config = Config(dataset=dataset, num_classes=10 if "l.npz" in dataset else 0)
    if message is None:
        sources.load(config)
        return
    with pytest.raises(UserError, match=message) as error:
        sources.load(config)
    assert "\n" not in str(error.value)


def test_npz_missing_key_and_corrupt_record_name_the_file(tmp_path):
    np.savez(tmp_path / "m.npz", x_train=np.zeros((4, 3)), y_train=np.zeros(4))
    with pytest.raises(UserError, match=r"m.npz.*missing arrays \['x_test', 'y_test'\]"):
        sources.load(Config(dataset=f"npz:{tmp_path}/m.npz"))
    x, y = id_arrays(20)
    paths = tfrecord.write_shards(str(tmp_path), "train", x, y, 2)
    with open(paths[1], "r+b") as f:
        f.seek(30)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(UserError, match=r"train-00001-of-00002.tfrecord: record 0 \(byte 0\): corrupted record at 12"):
        sources.load(Config(dataset=f"tfrecord:{tmp_path}/train-*"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_task_brings_its_own_datasets(tmp_path, replicas):
    result = train(
        small_config(
            tmp_path,
            task=f"{TASKS_DATA}:OwnDataTask",
            model="mlp",
            train_steps=30,
            steps_per_loop=10,
            strategy="mirrored",
            cpu_replicas=replicas,
            learning_rate=0.01,
        ),
        **QUIET,
    )
    assert result.final_step == 30
    assert result.eval_metrics["accuracy"] > 0.6  # 4 classes by sign pattern: learnable, far above 0.25


@pytest.mark.fast
def test_a_task_with_its_own_datasets_refuses_to_be_read_into_memory(tmp_path):
    with pytest.raises(UserError, match=r"--input_mode=resident .* OwnDataTask.datasets\(\) builds its own"):
        train(small_config(tmp_path, task=f"{TASKS_DATA}:OwnDataTask", model="mlp", input_mode="resident"), **QUIET)


def test_cache_is_refused_where_it_would_do_nothing(tmp_path):
    """--cache keeps a stream's raw records; on data held in memory, on records read into memory
    (resident) or with a Task's own pipelines it would be silently ignored, so it is one line."""
    x, y = id_arrays(20)
    tfrecord.write_shards(str(tmp_path), "train", x, y, 2)
    streamed = f"tfrecord:{tmp_path}/train-*"
    assert sources.load(Config(dataset=streamed, cache=True)).cache  # a stream: kept, and used
    refusals = [
        (
            Config(dataset="synthetic", cache=True),
            r"^--cache applies to streamed sources \(tfrecord:, images:, tfds:\) only, not --dataset=synthetic",
        ),
        (
            Config(dataset="npz:" + str(tmp_path / "missing.npz"), cache=True),  # refused before reading
            r"--cache applies to streamed sources .* not --dataset=npz:",
        ),
        (
            Config(dataset=streamed, cache=True, input_mode="resident"),
            r"--cache with --input_mode=resident: --dataset=tfrecord:.* read into memory once",
        ),
    ]
    for config, message in refusals:
        with pytest.raises(UserError, match=message) as error:
            sources.load(config)
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=r"--cache applies to streamed --dataset sources, but OwnDataTask.datasets"):
        train(small_config(tmp_path / "own", task=f"{TASKS_DATA}:OwnDataTask", model="mlp", cache=True), **QUIET)
