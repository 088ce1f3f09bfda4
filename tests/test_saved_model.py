"""--export_formats=saved_model: export/saved_model/<step>/ loads with plain tf.saved_model.load in a
process that never imports the engine, takes the data's RAW examples (preprocessing inside) and
predicts what the trained Keras model predicts, to 1e-5."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import small_config

from engine.controller.trainer import train
from engine.data.formats import normalise_features

QUIET = dict(out=open(os.devnull, "w"))

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
    proc = subprocess.run([sys.executable, "-c", SERVE, str(version_dir), str(tmp_path / "inputs.npy"),
                           str(tmp_path / "outputs.npz")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(tmp_path / "outputs.npz"))


def _trained(tmp_path, **overrides):
    result = train(small_config(tmp_path / "run", **{"model": "mlp", "export": True,
                                                      "export_formats": "keras,saved_model", **overrides}), **QUIET)
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


@pytest.mark.fast
def test_the_signature_takes_the_raw_dtype_and_shape(tmp_path):
    import tensorflow as tf

    version_dir, _ = _trained(tmp_path)
    signature = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    (inputs,) = signature.structured_input_signature[1].values()
    assert inputs.dtype == tf.uint8 and tuple(inputs.shape) == (None, 28, 28)
    assert set(signature.structured_outputs) == {"probabilities", "classes"}
