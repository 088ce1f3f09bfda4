"""Every private TensorFlow/Keras API the engine touches, one small function each.

Nothing outside this module imports `tensorflow.python`, `keras.src` or `tf.__internal__`, or
reads a private attribute of a TensorFlow/Keras object (tests/test_compat.py scans for it). Each
touch has a test there that names it when a release drops it ("Testing a new TensorFlow or Keras
release" in docs/install.md). The touches:

  skip_keras_all_reduce          Keras optimizer `_all_reduce_sum_gradients` (engine/update.py)
  custom_gradient_registry       `tensorflow.python.framework.ops._gradient_registry._registry` (engine/loop.py)
  device_datasets_without_autotune  `multi_device_iterator_ops._create_device_dataset` (engine/data/pipelines.py)
  flatten_layers                 Keras `Layer._flatten_layers` (engine/randomness.py, engine/refused_combinations.py)
  layer_seed_generators          Keras `Layer._seed_generators` (engine/randomness.py)
  wrap_seed_generator_next       `SeedGenerator.next` shadowed on the instance (engine/randomness.py)
  disable_op_determinism         `tensorflow.python.framework.config` (engine/controller/job.py)
  coordination_key_value_store   `tensorflow.python.eager.context.context()` (engine/distribute/stall.py)
  bound_cluster_registration     `context.context().configure_coordination_service` (engine/distribute/strategy.py)
  optimizer_learning_rate        Keras optimizer `_learning_rate` (engine/optimizers.py)
  is_trackable                   `tf.__internal__.tracking.Trackable` (engine/task_state.py)
  checkpoint_object_graph        a checkpoint's `_CHECKPOINTABLE_OBJECT_GRAPH` proto (engine/task_state.py)
"""

from __future__ import annotations

import types

import tensorflow as tf

from engine.errors import UserError

# The prefix tf.custom_gradient gives the names it registers in the gradient registry.
CUSTOM_GRADIENT_PREFIX = "CustomGradient-"


def skip_keras_all_reduce(optimizer, already_reduced) -> None:
    """Wraps the optimizer's private `_all_reduce_sum_gradients` so that it passes the gradients through
    while `already_reduced()` is true (the engine summed them: invariant 4), and sums as before otherwise;
    idempotent. A Keras without it raises UserError: the engine cannot hand it summed gradients."""
    original = getattr(optimizer, "_all_reduce_sum_gradients", None)
    if original is None:
        raise UserError(
            "this Keras version's optimizer has no _all_reduce_sum_gradients: the engine cannot hand "
            "it gradients already summed over replicas; use keras 3.x (tested 3.15)"
        )
    if getattr(original, "_engine_wrapped", False):
        return

    def all_reduce_sum_gradients(grads_and_vars):
        return list(grads_and_vars) if already_reduced() else original(grads_and_vars)

    all_reduce_sum_gradients._engine_wrapped = True
    optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients


def custom_gradient_registry():
    """TensorFlow's global {name: gradient function} registry (`ops._gradient_registry._registry`), from
    which engine/loop.py drops the custom gradients each trace registers (TF issue 97697); None where a
    version keeps it elsewhere (then nothing is dropped: traced graphs stay in memory, nothing breaks)."""
    from tensorflow.python.framework import ops

    return getattr(getattr(ops, "_gradient_registry", None), "_registry", None)


def device_datasets_without_autotune() -> None:
    """Wraps `multi_device_iterator_ops._create_device_dataset` once, so the per-device datasets that
    Mirrored strategies build (no public option reaches them) run without autotuning, whose thread made
    iterator deletion linger (engine/data/pipelines.py); a version without it: nothing is wrapped
    (tests/test_exit.py then shows the linger)."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
    if create is None or getattr(create, "without_autotune", False):
        return

    def create_without_autotune(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return create(*args, **kwargs).with_options(options)

    create_without_autotune.without_autotune = True
    multi_device_iterator_ops._create_device_dataset = create_without_autotune


def flatten_layers(model, include_self: bool) -> list:
    """Every layer of `model`, nested ones included, once each (Keras' private `_flatten_layers`; Keras 3
    has no public recursive walk); a Keras without it raises AttributeError."""
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def layer_seed_generators(layer) -> tuple:
    """The keras.random.SeedGenerators a layer owns (Keras' private `_seed_generators`), whose draws the
    engine folds per replica; a layer or Keras without the attribute: none."""
    return tuple(getattr(layer, "_seed_generators", ()))


def wrap_seed_generator_next(generator, next_function) -> bool:
    """Binds `next_function` as the instance's `next`, shadowing `SeedGenerator.next`, through which
    Keras' random ops draw each seed (a bound method, so deepcopy rebinds it); False if already bound."""
    method = generator.__dict__.get("next")
    if isinstance(method, types.MethodType) and method.__func__ is next_function:
        return False
    generator.next = types.MethodType(next_function, generator)
    return True


def disable_op_determinism() -> None:
    """Turns TensorFlow's process-wide op determinism off (`tensorflow.python.framework.config`: there is
    no public switch-off), as a run without --deterministic needs after one with it in the same process;
    a version without `is_op_determinism_enabled`: nothing is done."""
    from tensorflow.python.framework import config

    if getattr(config, "is_op_determinism_enabled", lambda: False)():
        config.disable_op_determinism()


def coordination_key_value_store():
    """TensorFlow's eager context (`tensorflow.python.eager.context.context()`), whose coordination-service
    calls `set/get/delete_config_key_value` reach every worker outside the collectives (the stall
    watch's heartbeats); a version without them fails when the watch starts."""
    from tensorflow.python.eager import context

    return context.context()


def bound_cluster_registration(jobs: dict, seconds: float) -> bool:
    """Configures TensorFlow's coordination service as MultiWorkerMirroredStrategy's constructor
    would (`context.context().configure_coordination_service`: standalone, led by the chief, else
    worker 0, coordinating the chief and worker jobs), plus `cluster_register_timeout_in_ms`, so a
    worker's registration with the leader gives up after `seconds` (DeadlineExceededError) instead
    of TensorFlow's default hour. The constructor keeps a configuration it finds. False when one
    was there already (nothing changed)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    if context.context().coordination_service is not None:
        return False
    names = [name for name in ("chief", "worker") if name in jobs]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{names[0]}/replica:0/task:0",
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=n, num_tasks=len(jobs[n])) for n in names],
        cluster_register_timeout_in_ms=int(seconds * 1000),
    )
    return True


def optimizer_learning_rate(optimizer):
    """The optimizer's private `_learning_rate`: a variable (a constant rate) or a schedule, which the
    public `learning_rate` (the current value) cannot tell apart; None where an optimizer lacks it."""
    return getattr(optimizer, "_learning_rate", None)


def is_trackable(value) -> bool:
    """Whether `value` is a TensorFlow Trackable (`tf.__internal__.tracking.Trackable`, the base of
    whatever tf.train.Checkpoint can hold); a version without it raises AttributeError."""
    return isinstance(value, tf.__internal__.tracking.Trackable)


def checkpoint_object_graph(checkpoint_path: str):
    """The TrackableObjectGraph proto a checkpoint stores under its private `_CHECKPOINTABLE_OBJECT_GRAPH`
    key (the names of the objects it holds, which its variable keys cannot tell); a checkpoint without it
    raises TensorFlow's NotFoundError."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(tf.train.load_checkpoint(checkpoint_path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return graph
