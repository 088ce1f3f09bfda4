"""--export_formats=saved_model: export/saved_model/<step>/ loads with plain tf.saved_model.load in a
process that never imports the engine, takes the data's RAW examples (preprocessing inside) and
predicts what the trained Keras model predicts, to 1e-5. Also: a version appears whole or not at all,
mixed precision serves float32, a model on its own input (a GAN's generator) is served as it is, and
every engine source gives the raw form (DataSpec.raw_features) its pipeline normalises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import QUIET, small_config

from engine.config import Config
from engine.controller.export import export_saved_model
from engine.controller.trainer import train
from engine.data import sources, tfrecord
from engine.data.builtin import synthetic_arrays
from engine.data.formats import normalise_features
from engine.data.spec import DataSpec


# Runs in a fresh interpreter: TensorFlow and NumPy only.
SERVE = """
import sys, numpy as np, tensorflow as tf
served = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
outputs = served(inputs=tf.constant(np.load(sys.argv[2])))
np.savez(sys.argv[3], **{k: v.numpy() for k, v in outputs.items()})
assert not any(name == "engine" or name.startswith("engine.") for name in sys.modules), "imported the engine"
"""


def _serve(version_dir, inputs, tmp_path) -> dict:
    np.save(tmp_path / "inputs.npy", inputs)
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(version_dir), str(tmp_path / "inputs.npy"), str(tmp_path / "outputs.npz")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(tmp_path / "outputs.npz"))


def _trained(tmp_path, **overrides):
    result = train(
        small_config(
            tmp_path / "run", **{"model": "mlp", "export": True, "export_formats": "keras,saved_model", **overrides}
        ),
        **QUIET,
    )
    version_dir = tmp_path / "run" / "export" / "saved_model" / str(result.final_step)
    model = keras.models.load_model(tmp_path / "run" / "export" / "model.keras")
    return version_dir, model


def test_the_saved_model_serves_raw_images_like_the_trained_model(tmp_path):
    version_dir, model = _trained(tmp_path, strategy="mirrored", cpu_replicas=2)
    assert sorted(os.listdir(version_dir.parent)) == ["6"]  # no staging directory left behind
    raw = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)  # as the source holds them
    served = _serve(version_dir, raw, tmp_path)
    expected = keras.ops.convert_to_numpy(keras.ops.softmax(model(normalise_features(raw))))
    np.testing.assert_allclose(served["probabilities"], expected, atol=1e-5)
    np.testing.assert_array_equal(served["classes"], expected.argmax(axis=-1))


def test_float_features_are_served_as_the_source_holds_them(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.random((256, 12))  # float64 in the file; float32 in training
    y = (x[:, 0] > 0.5).astype(np.int64)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:64], y_test=y[:64])
    version_dir, model = _trained(tmp_path, dataset=f"npz:{tmp_path / 'd.npz'}", global_batch=32)
    served = _serve(version_dir, x[:20], tmp_path)
    expected = keras.ops.convert_to_numpy(keras.ops.softmax(model(x[:20].astype(np.float32))))
    np.testing.assert_allclose(served["probabilities"], expected, atol=1e-5)


def test_the_signature_takes_the_raw_dtype_and_shape(tmp_path):
    version_dir, _ = _trained(
        tmp_path, train_steps=2, steps_per_loop=2, synthetic_train_examples=256, synthetic_test_examples=64
    )
    signature = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    (inputs,) = signature.structured_input_signature[1].values()
    assert inputs.dtype == tf.uint8 and tuple(inputs.shape) == (None, 28, 28)
    assert set(signature.structured_outputs) == {"probabilities", "classes"}


# ---- export_saved_model directly: atomic versions, mixed precision, a model on its own input ----
RAW_GREY = tf.TensorSpec((28, 28), tf.uint8)


def _classifier(policy=None):
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", dtype=policy),
            keras.layers.Dense(10, dtype=policy),
        ]
    )


def _load(version_dir):
    return tf.saved_model.load(str(version_dir)).signatures["serving_default"]


def test_a_version_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    model, spec = _classifier(), DataSpec.classification((28, 28, 1), 10, raw_features=RAW_GREY)
    directory = tmp_path / "saved_model"
    assert export_saved_model(model, spec, str(directory), 5) == str(directory / "5")
    assert os.listdir(directory) == ["5"]

    def crash(module, path, signatures=None):  # dies half-way through writing
        (Path(path) / "saved_model.pb").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(tf.saved_model, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        export_saved_model(model, spec, str(directory), 6)
    assert os.listdir(directory) == ["5"]  # no 6, no staging directory
    monkeypatch.undo()
    export_saved_model(model, spec, str(directory), 5)  # the same version again: replaced whole
    assert os.listdir(directory) == ["5"] and set(_load(directory / "5").structured_outputs) == {
        "probabilities",
        "classes",
    }


def test_logits_are_served_as_outputs_and_a_bad_choice_is_refused(tmp_path):
    model, spec = _classifier(), DataSpec.classification((28, 28, 1), 10, raw_features=RAW_GREY)
    raw = np.random.default_rng(3).integers(0, 256, (4, 28, 28), dtype=np.uint8)
    served = _load(export_saved_model(model, spec, str(tmp_path), 1, outputs="logits"))(inputs=tf.constant(raw))
    assert set(served) == {"outputs"}
    np.testing.assert_allclose(served["outputs"].numpy(), model(normalise_features(raw)).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="probabilities, logits"):
        export_saved_model(model, spec, str(tmp_path), 2, outputs="softmax")


def test_a_mixed_precision_model_serves_float32(tmp_path):
    model = _classifier(policy="mixed_bfloat16")
    spec = DataSpec.classification((28, 28, 1), 10, raw_features=RAW_GREY)
    raw = np.random.default_rng(4).integers(0, 256, (6, 28, 28), dtype=np.uint8)
    assert model(normalise_features(raw)).dtype == tf.bfloat16
    served = _load(export_saved_model(model, spec, str(tmp_path), 1))(inputs=tf.constant(raw))
    assert served["probabilities"].dtype == tf.float32
    expected = tf.nn.softmax(tf.cast(model(normalise_features(raw)), tf.float32)).numpy()
    np.testing.assert_allclose(served["probabilities"].numpy(), expected, atol=1e-5)


def test_a_model_on_its_own_input_is_served_without_the_data_normalisation(tmp_path):
    generator = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(28 * 28, activation="sigmoid"), keras.layers.Reshape((28, 28, 1))]
    )  # a GAN's export_model()
    spec = DataSpec.classification((28, 28, 1), 10, raw_features=RAW_GREY)
    signature = _load(export_saved_model(generator, spec, str(tmp_path), 1))
    (inputs,) = signature.structured_input_signature[1].values()
    assert inputs.dtype == tf.float32 and tuple(inputs.shape) == (None, 32)
    z = np.random.default_rng(5).normal(size=(3, 32)).astype(np.float32)
    np.testing.assert_allclose(signature(inputs=tf.constant(z))["outputs"].numpy(), generator(z).numpy(), atol=1e-6)


# ---- every engine source says what it holds before normalisation ----
def _png_folders(root, shape, n=6):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for i in range(n):
            folder = root / split / f"class{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            tf.io.write_file(str(folder / f"{i}.png"), tf.io.encode_png(rng.integers(0, 256, shape, dtype=np.uint8)))
    return root


def _serves_like_the_pipeline(source, tmp_path, raw):
    """The export of a model on `source`, fed the raw examples, predicts what the model predicts on
    the source's own decoded examples."""
    spec = source.spec
    model = keras.Sequential(
        [keras.Input(spec.input_shape), keras.layers.Flatten(), keras.layers.Dense(spec.num_classes)]
    )
    served = _load(export_saved_model(model, spec, str(tmp_path / "export"), 1))(inputs=tf.constant(raw))
    decoded, _ = next(source.test_batches(len(raw)))
    expected = tf.nn.softmax(model(decoded)).numpy()
    np.testing.assert_allclose(served["probabilities"].numpy(), expected, atol=1e-6)


def test_image_folders_are_served_as_decoded_uint8_images(tmp_path):
    root = _png_folders(tmp_path / "images", (12, 10, 3))
    source = sources.load(Config(dataset=f"images:{root}"))
    assert source.spec.raw_features == tf.TensorSpec((12, 10, 3), tf.uint8)
    files = [str(root / "test" / f"class{i % 2}" / f"{i}.png") for i in range(6)]
    order = sorted(files, key=lambda p: (p.split("/")[-2], p))  # the eval order: class by class
    raw = np.stack([tf.io.decode_png(tf.io.read_file(p)).numpy() for p in order])
    _serves_like_the_pipeline(source, tmp_path, raw)
    resized = sources.load(Config(dataset=f"images:{root}", image_size="8,8"))
    assert resized.spec.raw_features is None  # the resize needs the file's own size: served normalised


def test_tfrecord_sources_are_served_as_their_records_hold_them(tmp_path):
    images, labels = synthetic_arrays(12, seed=1)  # uint8 (28, 28)
    tfrecord.write_shards(str(tmp_path / "png"), "train", images, labels, 1)
    png = sources.load(Config(dataset=f"tfrecord:{tmp_path}/png/train-*.tfrecord", num_classes=10))
    assert png.spec.raw_features == tf.TensorSpec((28, 28, 1), tf.uint8)  # PNGs decode with a channel
    _serves_like_the_pipeline(png, tmp_path / "a", images[..., None])
    tfrecord.write_shards(str(tmp_path / "x"), "train", images, labels, 1, png=False)
    tensors = sources.load(Config(dataset=f"tfrecord:{tmp_path}/x/train-*.tfrecord", num_classes=10))
    assert tensors.spec.raw_features == tf.TensorSpec((28, 28), tf.uint8)
    _serves_like_the_pipeline(tensors, tmp_path / "b", images)
    resized = sources.load(Config(dataset=f"tfrecord:{tmp_path}/png/train-*.tfrecord", image_size="8,8"))
    assert resized.spec.raw_features is None


@pytest.mark.fast
def test_in_memory_sources_keep_the_arrays_dtype_and_shape(tmp_path):
    source = sources.load(Config(dataset="synthetic", synthetic_train_examples=64, synthetic_test_examples=16))
    assert source.spec.raw_features == RAW_GREY and source.spec.input_shape == (28, 28, 1)
    (tmp_path / "t.txt").write_text("hello serving world " * 20)
    text = sources.load(Config(dataset=f"text:{tmp_path / 't.txt'}", seq_len=16))
    assert text.spec.raw_features == tf.TensorSpec((16,), tf.int32)


def test_tfds_sources_are_served_as_their_features_decode(tmp_path):
    import tensorflow_datasets as tfds  # in the test extra

    class ServingShapes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict(
                {"image": tfds.features.Image(shape=(8, 8, 1)), "label": tfds.features.ClassLabel(num_classes=2)}
            )
            return tfds.core.DatasetInfo(builder=self, features=features, supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0), "test": self._generate_examples(100)}

        def _generate_examples(self, first):
            for i in range(first, first + 4):
                yield i, {"image": np.full((8, 8, 1), i, np.uint8), "label": i % 2}

    ServingShapes(data_dir=str(tmp_path / "tfds")).download_and_prepare()
    source = sources.load(Config(dataset="tfds:serving_shapes", data_dir=str(tmp_path / "tfds")))
    assert source.spec.raw_features == tf.TensorSpec((8, 8, 1), tf.uint8)
    decoded, _ = next(source.test_batches(4))  # in TFDS's shuffled order
    assert sorted(np.rint(decoded[:, 0, 0, 0] * 255)) == [100, 101, 102, 103]
    _serves_like_the_pipeline(source, tmp_path, np.rint(decoded * 255).astype(np.uint8))
