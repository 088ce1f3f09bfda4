"""Model registry: `--model` names -> builders of (input_shape, num_classes) -> keras.Model."""

from __future__ import annotations

import keras

from engine.errors import UserError
from engine.models.classifiers import cnn_bn, mlp, seed_cnn

MODELS = {"cnn": seed_cnn, "cnn_bn": cnn_bn, "mlp": mlp}


def build_model(name: str, input_shape, num_classes: int) -> keras.Model:
    if name not in MODELS:
        raise UserError(f"unknown --model={name!r}; valid: {', '.join(sorted(MODELS))}")
    return MODELS[name](input_shape, num_classes)
