"""Readers and pipelines: IDX validation, npz, synthetic data, shuffle/batch/skip order."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from engine.data import arrays, builtin, pipelines, sources
from engine.data import readers
from engine.config import Config
from engine.errors import UserError

pytestmark = pytest.mark.fast  # every test here runs in seconds: the fast lane (-m fast)


def write_idx(path, array, magic_type=0x08, compress=True, truncate=0):
    header = struct.pack(">BBBB", 0, 0, magic_type, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = (header + array.astype(np.uint8).tobytes())[: -truncate or None]
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(payload)


def write_idx_dir(directory, train=64, test=10, seed=0):
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), ("t10k", test)):
        write_idx(directory / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(directory / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))


def test_idx_round_trip(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", array)
    write_idx(tmp_path / "b", array, compress=False)
    np.testing.assert_array_equal(readers.read_idx(str(tmp_path / "a.gz")), array)
    np.testing.assert_array_equal(readers.read_idx(str(tmp_path / "b")), array)


@pytest.mark.parametrize(
    "kwargs, expected_ndim, message",
    [
        (dict(truncate=5), 3, "truncated"),
        (dict(magic_type=0x07), 3, "magic"),
        (dict(), 1, "dimensions"),
    ],
)
def test_idx_errors(tmp_path, kwargs, expected_ndim, message):
    write_idx(tmp_path / "x.gz", np.zeros((4, 28, 28)), **kwargs)
    with pytest.raises(UserError, match=message):
        readers.read_idx(str(tmp_path / "x.gz"), expected_ndim=expected_ndim)


def test_idx_errors_name_the_file(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="x.gz"):
        readers.read_idx(str(tmp_path / "x.gz"))


def test_idx_directory_loads_and_validates(tmp_path):
    write_idx_dir(tmp_path)
    data = sources.load(Config(dataset="fashion_mnist", data_dir=str(tmp_path)))
    assert data.x_train.shape == (64, 28, 28) and data.y_test.shape == (10,) and data.spec.input_shape == (28, 28, 1)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.full((10,), 11))
    with pytest.raises(UserError, match=r"labels range over \[11, 11\]"):
        sources.load(Config(dataset="fashion_mnist", data_dir=str(tmp_path)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros((9,)))
    with pytest.raises(UserError, match="10 images but 9 labels"):
        sources.load(Config(dataset="fashion_mnist", data_dir=str(tmp_path)))


def test_mnist_npz_from_data_dir(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.integers(0, 256, (32, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 32),
        x_test=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 8),
    )
    data = sources.load(Config(dataset="mnist", data_dir=str(tmp_path)))
    assert data.where.endswith("mnist.npz") and data.num_test == 8


def test_synthetic_is_deterministic_and_label_dependent():
    a_images, a_labels = builtin.synthetic_arrays(500, seed=3)
    b_images, b_labels = builtin.synthetic_arrays(500, seed=3)
    np.testing.assert_array_equal(a_images, b_images)
    np.testing.assert_array_equal(a_labels, b_labels)
    # The class means differ far more than the noise would by chance: the pixels carry the label.
    means = np.stack([a_images[a_labels == c].mean(axis=0) for c in range(10)])
    assert np.abs(means[0] - means[1]).mean() > 10


def _epoch_batches(dataset, count):
    return [labels.numpy() for _, labels in dataset.take(count)]


def test_train_pipeline_epochs_shuffles_and_skips():
    images = np.zeros((40, 28, 28), dtype=np.uint8)
    labels = np.arange(40) % 10
    images[:, 0, 0] = np.arange(40)  # pixel (0,0) identifies the example
    dataset = arrays.train_dataset(images, labels, global_batch=16, seed=5)
    batches = [x.numpy()[:, 0, 0, 0] * 255.0 for x, _ in dataset.take(6)]
    assert all(len(b) == 16 for b in batches)  # remainder dropped: 2 batches per epoch
    epoch1, epoch2 = np.concatenate(batches[0:2]), np.concatenate(batches[2:4])
    assert len(set(np.round(epoch1))) == 32  # no example twice in an epoch
    assert not np.array_equal(epoch1, epoch2)  # reshuffled each epoch
    again = [
        x.numpy()[:, 0, 0, 0] * 255.0 for x, _ in arrays.train_dataset(images, labels, global_batch=16, seed=5).take(6)
    ]
    np.testing.assert_array_equal(np.concatenate(batches), np.concatenate(again))  # seeded
    skipped = [
        x.numpy()[:, 0, 0, 0] * 255.0
        for x, _ in arrays.train_dataset(images, labels, global_batch=16, seed=5, skip_batches=3).take(3)
    ]
    np.testing.assert_array_equal(np.concatenate(batches[3:]), np.concatenate(skipped))  # resume


def test_eval_pipeline_keeps_the_partial_batch():
    images, labels = builtin.synthetic_arrays(37, seed=1)
    sizes = [int(batch_labels.shape[0]) for _, batch_labels in arrays.eval_dataset(images, labels, global_batch=16)]
    assert sizes == [16, 16, 5]


def test_global_batch_larger_than_data_is_an_error():
    data = sources.load(Config(dataset="synthetic", synthetic_train_examples=10, synthetic_test_examples=5))
    with pytest.raises(UserError, match="larger than the 10 training examples"):
        pipelines.steps_per_epoch(data, 64)


@pytest.mark.fast
def test_uint8_normalisation_on_cpu_is_bit_identical_to_cast_and_multiply():
    """tf.data maps (and arrays resident on CPUs) scale uint8 by Dequantize, a GPU-less kernel;
    arrays resident on a GPU by a cast and a multiply. Every value must come out the same bits,
    or N replicas on GPUs would not train like the tf.data path; grey (H, W) images gain a channel."""
    import tensorflow as tf

    from engine.data.formats import normalise_features

    every_value = tf.reshape(tf.range(256, dtype=tf.int32), [2, 8, 16])
    every_value = tf.cast(every_value, tf.uint8)
    fused, plain = normalise_features(every_value, on_cpu=True), normalise_features(every_value)
    assert fused.dtype == plain.dtype == tf.float32 and fused.shape == plain.shape == (2, 8, 16, 1)
    np.testing.assert_array_equal(fused.numpy().view(np.uint32), plain.numpy().view(np.uint32))
    assert float(tf.reduce_max(fused)) == 1.0 and float(tf.reduce_min(fused)) == 0.0

    traced = tf.function(lambda x: normalise_features(x, on_cpu=True))(every_value)
    np.testing.assert_array_equal(traced.numpy().view(np.uint32), plain.numpy().view(np.uint32))
