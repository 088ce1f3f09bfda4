"""Any model: `--model` as a registered name (the built-in resnet20), `package.module:function`,
`path/to/file.py:function` and `keras.applications.NAME`, trained by the real engine. The bad
forms' one-line errors are in tests/test_cli.py's BAD_INPUTS catalogue."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, REPO, max_difference, small_config, trained_by_name
from engine.controller.trainer import train
from engine.data.spec import DataSpec
from engine.models.registry import build_model
from engine.task import Task
from engine.config import default_model_dir

COLOUR_32 = dict(synthetic_shape="32,32,3")  # CIFAR-sized synthetic images

WITH_SPEC = '''

def with_spec(input_shape, num_classes, spec):
    """Asks for the data's spec: names the model after its feature dtype and classes."""
    return keras.Sequential([keras.Input(shape=input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)],
                            name=f"spec_{spec.features.dtype.name}_{spec.num_classes}")
'''


def readme_model_file() -> str:
    """The complete example model file of docs/models.md "Bring your own model" (its first python block)."""
    with open(os.path.join(REPO, "docs", "models.md")) as f:
        section = f.read().split("## Bring your own model", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def user_models(tmp_path):
    """docs/models.md's my_models.py (small_cnn), plus a builder that asks for the spec."""
    path = tmp_path / "my_models.py"
    path.write_text(readme_model_file() + WITH_SPEC)
    return str(path)


# ---- the built-in resnet20 ----


def test_resnet20_shape_parameters_and_names():
    model = build_model("resnet20", (32, 32, 3), 10)
    logits = model(tf.zeros([2, 32, 32, 3]), training=False)
    assert logits.shape == (2, 10) and logits.dtype == tf.float32
    # convolutions without biases: stem 3*3*3*16; stage 1: 6 x 3*3*16*16; stage 2: 3*3*16*32 +
    # 5 x 3*3*32*32 + projection 16*32; stage 3: 3*3*32*64 + 5 x 3*3*64*64 + projection 32*64.
    convolutions = 432 + 6 * 2_304 + (4_608 + 5 * 9_216 + 512) + (18_432 + 5 * 36_864 + 2_048)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    channels = sum(layer.gamma.shape[0] for layer in norms)  # 16 * 7 + 32 * 7 + 64 * 7
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert (convolutions, channels) == (270_256, 784)
    assert trainable == convolutions + 2 * channels + 64 * 10 + 10 == 272_474
    assert model.count_params() == trainable + 2 * channels == 274_042  # + moving mean and variance
    # 20 weighted layers on the main path: 19 3x3 convolutions and the dense layer.
    kernels_3x3 = [
        layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D) and layer.kernel_size == (3, 3)
    ]
    assert len(kernels_3x3) == 19
    assert len(norms) == 21 and all(layer.synchronized and layer.momentum == 0.9 for layer in norms)
    assert model.get_layer("stage2_block1_conv1").strides == (2, 2)
    assert model.get_layer("stage3_block1_shortcut_conv").kernel_size == (1, 1)
    # Every layer named (none of Keras' numbered defaults): a second build has the same weight paths.
    assert all(layer.name.startswith(("images", "stem_", "stage", "pool", "logits")) for layer in model.layers)
    paths = [w.path for w in model.weights]
    assert paths == [w.path for w in build_model("resnet20", (32, 32, 3), 10).weights]
    # Other image sizes work too (global average pooling).
    assert build_model("resnet20", (28, 28, 1), 7)(tf.zeros([1, 28, 28, 1])).shape == (1, 7)


def test_resnet20_two_replicas_train_like_one(tmp_path):
    """Batch norm synchronised across replicas: 2 replicas train (weights AND moving statistics) like
    one replica fed the same global batch.

    Measured (2 SGD steps at learning rate 0.01): synchronised, weights differ by up to 2.5e-5 and
    moving statistics by 5e-6; built with synchronized=False, the moving statistics differ by 3e-2.
    The weights' difference is float32 rounding, amplified by batch norm's backward pass (a sum with
    much cancellation): a single device's gradients differ by ~3% of their largest element when the
    batch's examples are merely permuted, and by ~1e-12 in float64 (permuted or split in two). It
    grows with the learning rate and the steps (2 steps at 0.05: 3e-4), hence the small rate."""
    settings = dict(model="resnet20", optimizer="sgd", learning_rate=0.01, train_steps=2, steps_per_loop=2, **COLOUR_32)
    one = trained_by_name(tmp_path / "one", strategy="default", **settings)
    two = trained_by_name(tmp_path / "two", strategy="mirrored", cpu_replicas=2, **settings)
    moved = max(float(np.max(np.abs(w))) for n, w in one.items() if n.endswith("moving_mean"))
    assert moved > 0.1, "the moving statistics must have moved from their initial 0 (mean)"
    assert max_difference(one, two, moving_only=True) < 5e-5
    assert max_difference(one, two) < 2e-4


# ---- the user's function: path/to/file.py:function and package.module:function ----


def test_model_from_file_two_replicas_train_like_one(tmp_path, user_models):
    """docs/models.md's example file, --model=my_models.py:small_cnn: its synchronised batch norm makes 2
    replicas train like 1 (2 SGD steps, as for cnn_bn in tests/test_models.py)."""
    settings = dict(model=f"{user_models}:small_cnn", optimizer="sgd", train_steps=2, steps_per_loop=2)
    one = trained_by_name(tmp_path / "one", strategy="default", **settings)
    two = trained_by_name(tmp_path / "two", strategy="mirrored", cpu_replicas=2, **settings)
    built = build_model(settings["model"], (28, 28, 1), 10)
    assert built.name == "small_cnn" and len(one) == len(built.weights) == 12  # the file's network
    assert float(np.max(np.abs(one["block1_bn/moving_mean"]))) > 1e-3, "training must move the statistics"
    assert max_difference(one, two) < 1e-5


def test_builder_that_asks_for_the_spec_gets_it(tmp_path, user_models):
    spec = DataSpec.classification((28, 28, 1), 10)
    task = Task(small_config(tmp_path, model=f"{user_models}:with_spec"), spec=spec)
    assert task.build_model().name == "spec_float32_10"
    assert (
        build_model(f"{user_models}:small_cnn", (28, 28, 1), 10, spec=spec).name == "small_cnn"
    )  # not asked: not given


def test_package_module_function_form(tmp_path):
    model = build_model("engine.models.classifiers:mlp", (28, 28, 1), 10)
    registered = build_model("mlp", (28, 28, 1), 10)
    assert model.name == "mlp" and model.count_params() == registered.count_params()
    assert [type(layer) for layer in model.layers] == [type(layer) for layer in registered.layers]
    result = train(
        small_config(
            tmp_path,
            model="engine.models.classifiers:mlp",
            strategy="mirrored",
            cpu_replicas=2,
            train_steps=2,
            steps_per_loop=2,
        ),
        **QUIET,
    )
    assert result.final_step == 2 and result.eval_metrics["accuracy"] >= 0


@pytest.mark.fast
def test_default_model_dir_names_the_model_form():
    def name(model):
        return os.path.basename(default_model_dir("synthetic", model, "default")).split("-")[1]

    assert [
        name(m)
        for m in (
            "cnn",
            "/home/me/nets/my net.py:build",
            "engine.models.classifiers:mlp",
            "keras.applications.ResNet50",
        )
    ] == ["cnn", "my_net_build", "classifiers_mlp", "ResNet50"]


# ---- keras.applications.NAME ----


def test_keras_application_outputs_logits_without_its_preprocessing():
    """Built untrained for the data's shape and classes; logits out (no softmax); the application's
    own rescaling from [0, 255] is off, as the engine's images are already in [0, 1]."""
    model = build_model("keras.applications.MobileNetV3Small", (32, 32, 3), 7)
    assert model.input_shape == (None, 32, 32, 3)
    outputs = model(tf.random.uniform([4, 32, 32, 3], seed=1), training=False).numpy()
    assert outputs.shape == (4, 7)
    assert outputs.min() < 0 or not np.allclose(outputs.sum(axis=1), 1.0), "softmax output, not logits"
    assert not any(isinstance(layer, keras.layers.Rescaling) for layer in model.layers)


def test_keras_application_trains_on_two_replicas_and_exports(tmp_path):
    """VGG16: the cheapest application to run here that accepts 32x32x3 (few layers, so it traces
    fast: 12-30 s for this run with the CPU shared, against ~70 s for MobileNet and ~100 s for
    MobileNetV2 or MobileNetV3Small under the same load)."""
    result = train(
        small_config(
            tmp_path,
            model="keras.applications.VGG16",
            strategy="mirrored",
            cpu_replicas=2,
            train_steps=2,
            steps_per_loop=2,
            global_batch=32,
            synthetic_train_examples=128,
            synthetic_test_examples=32,
            summaries="basic",
            export=True,
            **COLOUR_32,
        ),
        **QUIET,
    )
    assert result.final_step == 2 and np.isfinite(result.train_metrics["loss"])
    loaded = keras.models.load_model(os.path.join(str(tmp_path), "export", "model.keras"))
    assert loaded.name == "vgg16" and loaded.output_shape == (None, 10)
    assert np.all(np.isfinite(loaded(tf.zeros([1, 32, 32, 3])).numpy()))
