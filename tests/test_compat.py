"""Every private TensorFlow/Keras touch of the engine (engine/compat.py): one test each that names
the touch when a release drops or changes it, and a scan that keeps every such touch in compat.
Run this module first on a new TensorFlow or Keras ("Testing a new TensorFlow or Keras release" in
docs/install.md)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import REPO
from engine import compat
from engine.distribute.strategy import build_strategy
from engine.errors import UserError


VERSIONS = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def _gone(touch: str, what: str) -> str:
    return f"compat touch {touch}: {what} is gone in {VERSIONS}; see engine/compat.py"


# ---- skip_keras_all_reduce: Keras optimizer `_all_reduce_sum_gradients` ----


def _summed_update(already_reduced: bool) -> float:
    """Each of 2 replicas all-reduces a gradient of 1 itself (sum 2) and applies it with SGD(1) to a
    variable at 0, with the engine's skip installed; -2: summed once, -4: Keras summed again."""
    strategy = build_strategy("mirrored", 2).strategy
    with strategy.scope():
        variable = tf.Variable(0.0)
        optimizer = keras.optimizers.SGD(learning_rate=1.0)
        optimizer.build([variable])
    compat.skip_keras_all_reduce(optimizer, lambda: already_reduced)

    def step():
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))
        optimizer.apply_gradients([(summed, variable)])

    tf.function(lambda: strategy.run(step))()
    return float(variable.numpy())


def test_keras_optimizer_all_reduce_hook():
    assert hasattr(keras.optimizers.SGD(), "_all_reduce_sum_gradients"), _gone(
        "skip_keras_all_reduce", "Keras optimizer's _all_reduce_sum_gradients"
    )
    source = inspect.getsource(type(keras.optimizers.SGD())._backend_update_step)
    assert "self._all_reduce_sum_gradients(" in source, _gone(
        "skip_keras_all_reduce", "the call of _all_reduce_sum_gradients in the optimizer's update step"
    )
    assert _summed_update(already_reduced=True) == -2.0, (
        "compat touch skip_keras_all_reduce: the engine's sum was summed again by Keras (invariant 4)"
    )
    assert _summed_update(already_reduced=False) == -4.0, (
        "compat touch skip_keras_all_reduce: outside the engine's apply Keras no longer sums itself"
    )


def test_keras_all_reduce_skip_is_installed_once_and_refuses_an_optimizer_without_the_hook():
    optimizer = keras.optimizers.SGD()
    compat.skip_keras_all_reduce(optimizer, lambda: True)
    wrapped = optimizer._all_reduce_sum_gradients
    compat.skip_keras_all_reduce(optimizer, lambda: True)
    assert optimizer._all_reduce_sum_gradients is wrapped
    with pytest.raises(UserError, match="no _all_reduce_sum_gradients"):
        compat.skip_keras_all_reduce(object(), lambda: True)


# ---- custom_gradient_registry: `ops._gradient_registry._registry` ----


def test_custom_gradient_registry_grows_when_a_custom_gradient_is_traced():
    registry = compat.custom_gradient_registry()
    assert isinstance(registry, dict), _gone("custom_gradient_registry", "ops._gradient_registry._registry")
    before = set(registry)

    @tf.custom_gradient
    def double(x):
        return 2 * x, lambda dy: 2 * dy

    tf.function(lambda x: double(x)).get_concrete_function(tf.TensorSpec([], tf.float32))
    added = [str(name) for name in set(registry) - before]
    assert added and all(name.startswith(compat.CUSTOM_GRADIENT_PREFIX) for name in added), (
        f"compat touch custom_gradient_registry: tracing a tf.custom_gradient added {added} to the registry, "
        f"not one name starting {compat.CUSTOM_GRADIENT_PREFIX!r}"
    )
    for name in set(registry) - before:
        del registry[name]


# ---- device_datasets_without_autotune: `multi_device_iterator_ops._create_device_dataset` ----


def test_per_device_dataset_builder():
    from tensorflow.python.data.ops import multi_device_iterator_ops

    assert hasattr(multi_device_iterator_ops, "_create_device_dataset"), _gone(
        "device_datasets_without_autotune", "multi_device_iterator_ops._create_device_dataset"
    )
    assert "_create_device_dataset(" in inspect.getsource(multi_device_iterator_ops), _gone(
        "device_datasets_without_autotune", "the MultiDeviceIterator's call of _create_device_dataset"
    )
    compat.device_datasets_without_autotune()
    wrapped = multi_device_iterator_ops._create_device_dataset
    compat.device_datasets_without_autotune()
    assert wrapped.without_autotune and multi_device_iterator_ops._create_device_dataset is wrapped  # once
    strategy = build_strategy("mirrored", 2).strategy
    batches = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4)))
    parts = [v.numpy().tolist() for v in strategy.experimental_local_results(next(batches))]
    assert parts == [[0, 1], [2, 3]], "compat touch device_datasets_without_autotune: the wrapped builder broke"


# ---- flatten_layers, layer_seed_generators, wrap_seed_generator_next: Keras layers and seeds ----


def _nested_model():
    # Named layers: Keras numbers default names per process ("dense_3" after other tests' models).
    layers = [keras.layers.GaussianNoise(0.1, name="gaussian_noise"), keras.layers.Dense(4, name="dense")]
    inner = keras.Sequential([keras.Input((4,)), *layers], name="inner")
    return keras.Sequential([keras.Input((4,)), inner, keras.layers.Dropout(0.5, name="dropout")], name="outer")


def test_keras_flatten_layers():
    assert hasattr(keras.layers.Layer, "_flatten_layers"), _gone("flatten_layers", "keras Layer._flatten_layers")
    model = _nested_model()
    names = [layer.name for layer in compat.flatten_layers(model, include_self=False)]
    assert {"inner", "gaussian_noise", "dense", "dropout"} <= set(names) and len(set(names)) == len(names), (
        f"compat touch flatten_layers: a nested model gave {names}"
    )
    assert compat.flatten_layers(model, include_self=True)[0] is model, "compat touch flatten_layers: self first"


def test_keras_layer_seed_generators():
    layer = keras.layers.Dropout(0.5)
    assert hasattr(layer, "_seed_generators"), _gone("layer_seed_generators", "keras Layer._seed_generators")
    assert compat.layer_seed_generators(layer) == (layer.seed_generator,), (
        "compat touch layer_seed_generators: Dropout's generator is not in _seed_generators"
    )
    assert compat.layer_seed_generators(object()) == ()


def test_keras_random_ops_draw_through_the_instance_next():
    assert "ordered" in inspect.signature(keras.random.SeedGenerator.next).parameters, _gone(
        "wrap_seed_generator_next", "SeedGenerator.next(ordered=...)"
    )
    calls = []

    def counted_next(self, ordered=True):
        calls.append(ordered)
        return type(self).next(self, ordered=ordered)

    generator = keras.random.SeedGenerator(3)
    assert compat.wrap_seed_generator_next(generator, counted_next)
    assert not compat.wrap_seed_generator_next(generator, counted_next)  # already bound
    keras.random.uniform((2,), seed=generator)
    assert calls, "compat touch wrap_seed_generator_next: Keras' random ops no longer draw through seed.next()"


# ---- disable_op_determinism: `tensorflow.python.framework.config` ----


def test_op_determinism_switch_off():
    from tensorflow.python.framework import config

    for name in ("is_op_determinism_enabled", "disable_op_determinism"):
        assert hasattr(config, name), _gone("disable_op_determinism", f"tensorflow.python.framework.config.{name}")
    tf.config.experimental.enable_op_determinism()
    try:
        assert config.is_op_determinism_enabled()
        compat.disable_op_determinism()
        assert not config.is_op_determinism_enabled(), "compat touch disable_op_determinism: still enabled"
    finally:
        config.disable_op_determinism()


# ---- coordination_key_value_store: `tensorflow.python.eager.context.context()` ----


@pytest.mark.fast
def test_coordination_service_key_value_calls():
    store = compat.coordination_key_value_store()
    for name in ("set_config_key_value", "get_config_key_value", "delete_config_key_value"):
        assert callable(getattr(store, name, None)), _gone(
            "coordination_key_value_store", f"tensorflow.python.eager.context.context().{name}"
        )
    # One process, no cluster: the call reaches the coordination agent, which is not running.
    with pytest.raises(tf.errors.FailedPreconditionError, match="[Cc]oordination service"):
        store.set_config_key_value("ctl_engine_compat_test", "1")


# ---- bound_cluster_registration: `context.context().configure_coordination_service` ----


def test_bound_cluster_registration_configures_what_the_strategy_would_plus_the_timeout():
    code = (
        "from engine import compat\n"
        "from tensorflow.python.eager import context\n"
        "jobs = {'worker': ['127.0.0.1:1', '127.0.0.1:2'], 'chief': ['127.0.0.1:3']}\n"
        "assert compat.bound_cluster_registration(jobs, 7.5)\n"
        "assert not compat.bound_cluster_registration(jobs, 1.0)\n"
        "c = context.context().coordination_service\n"
        "print(c.service_type, c.service_leader, c.cluster_register_timeout_in_ms,"
        " [(j.name, j.num_tasks) for j in c.coordinated_job_list])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, _gone("bound_cluster_registration", done.stderr.strip().splitlines()[-1:])
    assert done.stdout.split("\n")[-2] == (
        "standalone /job:chief/replica:0/task:0 7500 [('chief', 1), ('worker', 2)]"
    ), done.stdout


# ---- optimizer_learning_rate: Keras optimizer `_learning_rate` ----


def test_keras_optimizer_learning_rate_or_schedule():
    constant = keras.optimizers.SGD(learning_rate=0.25)
    assert hasattr(constant, "_learning_rate"), _gone("optimizer_learning_rate", "Keras optimizer._learning_rate")
    assert float(keras.ops.convert_to_numpy(compat.optimizer_learning_rate(constant))) == 0.25
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 10)
    assert compat.optimizer_learning_rate(keras.optimizers.SGD(learning_rate=schedule)) is schedule, (
        "compat touch optimizer_learning_rate: _learning_rate no longer holds the schedule itself"
    )


# ---- is_trackable, checkpoint_object_graph: tracking and the checkpoint's object graph ----


def test_tensorflow_trackable_base():
    assert hasattr(getattr(tf.__internal__, "tracking", None), "Trackable"), _gone(
        "is_trackable", "tf.__internal__.tracking.Trackable"
    )
    for value in (tf.Variable(1.0), tf.Module(), keras.layers.Dense(2), keras.optimizers.SGD()):
        assert compat.is_trackable(value), f"compat touch is_trackable: {type(value).__name__} is not trackable"
    assert not compat.is_trackable(np.zeros(2))


def test_checkpoint_object_graph(tmp_path):
    path = tf.train.Checkpoint(task=tf.train.Checkpoint(teacher=tf.Variable(1.0))).write(str(tmp_path / "ckpt"))
    graph = compat.checkpoint_object_graph(path)
    root = {child.local_name: child.node_id for child in graph.nodes[0].children}
    assert "task" in root, _gone("checkpoint_object_graph", "the _CHECKPOINTABLE_OBJECT_GRAPH proto's root children")
    assert [child.local_name for child in graph.nodes[root["task"]].children] == ["teacher"]


# ---- the scan: every private touch lives in engine/compat.py ----

# Private names the engine touches; any other file naming one (attribute or string) bypasses compat.
PRIVATE_NAMES = {
    "_all_reduce_sum_gradients",
    "_gradient_registry",
    "_create_device_dataset",
    "_flatten_layers",
    "_seed_generators",
    "_learning_rate",
    "_CHECKPOINTABLE_OBJECT_GRAPH",
    "__internal__",
}
PRIVATE_MODULES = ("tensorflow.python", "keras.src")
TF_KERAS_NAMES = {"tf", "tensorflow", "keras"}


def _scanned_files() -> list:
    files = [pathlib.Path(REPO, "run.py")]
    for package in ("engine", "flags"):
        files += sorted(pathlib.Path(REPO, package).rglob("*.py"))
    return [path for path in files if path != pathlib.Path(REPO, "engine", "compat.py")]


def _root_name(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_touches(source: str) -> list:
    """(line, what) for each private TensorFlow/Keras touch in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found += [(node.lineno, f"imports {m}") for m in modules if m.startswith(PRIVATE_MODULES)]
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_NAMES:
                found.append((node.lineno, f".{node.attr}"))
            elif node.attr.startswith("_") and _root_name(node) in TF_KERAS_NAMES:
                found.append((node.lineno, f"{_root_name(node)}....{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PRIVATE_NAMES:
            found.append((node.lineno, repr(node.value)))
    return sorted(set(found))


def test_every_private_touch_lives_in_compat():
    offenders = {
        str(path.relative_to(REPO)): touches
        for path in _scanned_files()
        if (touches := private_touches(path.read_text()))
    }
    assert not offenders, (
        f"private TensorFlow/Keras touches outside engine/compat.py (put each in compat with a test here): {offenders}"
    )


def test_the_scan_finds_each_kind_of_touch():
    source = """
from tensorflow.python.framework import ops
import keras.src.layers
layers = model._flatten_layers(include_self=True)
rate = getattr(optimizer, "_learning_rate", None)
base = tf.__internal__.tracking.Trackable
x = tf.keras._private_thing
"""
    assert sorted({line for line, _ in private_touches(source)}) == [2, 3, 4, 5, 6, 7]
    assert private_touches("self._learning = model.name\nos._exit(1)\n") == []


def test_the_compat_docstring_lists_every_touch():
    doc = inspect.getmodule(compat).__doc__
    functions = [name for name, value in vars(compat).items() if inspect.isfunction(value) and not name.startswith("_")]
    functions = [name for name in functions if inspect.getmodule(vars(compat)[name]) is compat]
    missing = [name for name in functions if not re.search(rf"^\s+{name}\s", doc, re.M)]
    assert not missing, f"engine/compat.py's docstring does not list {missing}"
    assert all(vars(compat)[name].__doc__ for name in functions), "every compat function says what it touches"
