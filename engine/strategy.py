"""Strategy factory: the `--strategy` name, logical CPU replicas, chief/worker roles."""

from __future__ import annotations

import dataclasses
import json
import os

import tensorflow as tf

from engine.errors import UserError

STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process sits in the run: what the banner prints and what decides who writes."""

    strategy: tf.distribute.Strategy
    name: str
    devices: tuple
    is_chief: bool
    task_type: str | None = None
    task_id: int | None = None
    num_workers: int = 1

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync


def configure_cpu_replicas(count: int) -> None:
    """Split the host CPU into `count` logical devices, so `mirrored` runs that many replicas.

    Must run before TensorFlow initialises its devices. If it already has (a test process, say),
    the existing logical devices are used when there are enough of them.
    """
    if count < 1:
        raise UserError(f"--cpu_replicas must be >= 1, got {count}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) >= count:
        return
    if current is None and count == 1:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have < count:
            raise UserError(
                f"--cpu_replicas={count}: TensorFlow was already initialised with {have} CPU "
                "device(s); set the replica count before any TensorFlow work (a fresh process)"
            ) from None


def build_strategy(name: str, cpu_replicas: int = 1, collective_timeout: float = 300.0) -> Placement:
    """Builds the strategy called `name` (one of STRATEGIES) and says where this process sits."""
    if name not in STRATEGIES:
        raise UserError(f"unknown --strategy={name!r}; valid: {', '.join(STRATEGIES)}")
    configure_cpu_replicas(cpu_replicas)
    # Physical device lists do not initialise the runtime (logical ones do, and the
    # multi-worker strategy must configure collectives before that happens).
    gpus = [f"/gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]
    if name == "multi_worker_mirrored":
        return _multi_worker(collective_timeout, gpus)
    if name == "default":
        strategy = tf.distribute.get_strategy()
        return Placement(strategy, name, (gpus[0] if gpus else "/cpu:0",), is_chief=True)
    if name == "one_device":
        device = "/gpu:0" if gpus else "/cpu:0"
        return Placement(tf.distribute.OneDeviceStrategy(device), name, (device,), is_chief=True)
    devices = tuple(gpus) if gpus else tuple(f"/cpu:{i}" for i in range(cpu_replicas))
    # Every MirroredStrategy starts its collective group and instance keys at the same numbers, and
    # the runtime remembers a key's tensor shape process-wide: a second strategy in one process
    # (train() called twice, as the tests do) whose first collectives differ from the first
    # strategy's fails with "Shape mismatch in the collective instance 100". Give each one its own
    # key range, as TensorFlow's own tests do (strategy_combinations.py).
    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    strategy = tf.distribute.MirroredStrategy(list(devices))
    return Placement(strategy, name, devices, is_chief=True)


def _multi_worker(collective_timeout: float, gpus: list) -> Placement:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise UserError(
            "--strategy=multi_worker_mirrored needs TF_CONFIG (a JSON cluster spec) in the "
            "environment of every worker; see README 'Several machines'"
        )
    try:
        tf_config = json.loads(raw)
        cluster = tf_config["cluster"]
        task = tf_config["task"]
        task_type, task_id = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"TF_CONFIG is not a valid cluster spec ({err!r}): {raw[:200]}") from None
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=collective_timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    is_chief = task_type == "chief" or (task_type == "worker" and task_id == 0 and "chief" not in cluster)
    num_workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    return Placement(
        strategy, "multi_worker_mirrored", tuple(gpus) or ("/cpu:0",), is_chief,
        task_type=task_type, task_id=task_id, num_workers=num_workers,
    )


def per_replica_batch(global_batch: int, num_replicas: int) -> int:
    """The batch each replica sees; a global batch that does not split evenly is an error."""
    if global_batch % num_replicas:
        raise UserError(
            f"--global_batch={global_batch} is not divisible by the {num_replicas} replicas; "
            f"use a multiple of {num_replicas} (e.g. {num_replicas * max(1, global_batch // num_replicas)})"
        )
    return global_batch // num_replicas


def check_variables_in_scope(strategy: tf.distribute.Strategy, variables) -> None:
    """Stops with a clear error when a variable was created outside `strategy.scope()`."""
    outside = [
        v.path if hasattr(v, "path") else v.name
        for v in variables
        if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
    ]
    if outside:
        raise UserError(
            f"{len(outside)} variable(s) were created outside strategy.scope() (first: {outside[0]}); "
            "build the model inside Task.build_model, not in Task.__init__ or at import time"
        )
