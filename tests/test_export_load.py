"""model.keras is reported as exported only when keras.models.load_model reads it back; otherwise
one line says why and the SavedModel (which serves any model) is the export."""

from __future__ import annotations

import os

from helpers import explain, run_cli

LAMBDA_MODEL = """
import keras


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Lambda(lambda t: t * 2.0)(x)  # a Python lambda: load_model refuses it (safe mode)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
"""


def test_a_model_keras_that_does_not_load_is_named_not_reported(tmp_path):
    (tmp_path / "lambda_model.py").write_text(LAMBDA_MODEL)
    run = tmp_path / "run"
    proc = run_cli(
        "--dataset=synthetic",
        "--synthetic_train_examples=256",
        "--synthetic_test_examples=64",
        f"--model={tmp_path / 'lambda_model.py'}:build",
        "--train_steps=2",
        "--global_batch=32",
        "--export_formats=keras,saved_model",
        f"--model_dir={run}",
        timeout=180,
    )
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.splitlines()
    warned = [line for line in lines if "does not load back" in line]
    assert len(warned) == 1 and "Lambda" in warned[0] and "saved_model" in warned[0], explain(proc)
    exported = [line for line in lines if "exported model" in line]
    assert len(exported) == 1 and "saved_model" in exported[0] and "model.keras" not in exported[0], explain(proc)
    assert os.path.exists(run / "export" / "model.keras")  # written, for load_model(safe_mode=False)
