"""Strategy factory: the `--strategy` name, logical CPU replicas, chief/worker roles."""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from engine.distribute.cluster import Cluster, parse_tf_config
from engine.config import STRATEGIES
from engine.errors import UserError
from engine.distribute.watchdog import rendezvous
from engine.errors import ClusterNotFormed
from engine import compat
from engine import startup_signals


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
    cluster: Cluster | None = None

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
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
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
    if gpus:
        devices = tuple(gpus)
        strategy = tf.distribute.MirroredStrategy(list(devices))  # NCCL all-reduce
    else:
        # Logical CPU devices share one memory: reduce through one device. (The default here,
        # collective all-reduce, also keys its instances per process, so two strategies in one
        # process, as in tests, could pair up each other's all-reduces.)
        devices = tuple(f"/cpu:{i}" for i in range(cpu_replicas))
        strategy = tf.distribute.MirroredStrategy(
            list(devices), cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:0")
        )
    return Placement(strategy, name, devices, is_chief=True)


def _multi_worker(collective_timeout: float, gpus: list) -> Placement:
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    # No per-collective timeout: TensorFlow (up to 2.21 at least) arms each timed collective with a
    # detached thread that sleeps for the whole timeout, so a long run piles up sleeping threads
    # until it can start no more ("Resource temporarily unavailable"; docs/strategies.md has the
    # run that died). A lost worker is still an error after --collective_timeout: the rendezvous
    # bounds the start, the PeerWatchdog (and TensorFlow's own heartbeat) the run.
    rendezvous(cluster, collective_timeout, check=startup_signals.check)
    # Every peer answered; if one dies before TensorFlow's registration, a worker's registration
    # with the leader still ends after --collective_timeout (the leader itself waits on: a finding
    # in docs/strategies.md, what the engine checks).
    compat.bound_cluster_registration(cluster.jobs, collective_timeout)
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions()
        )
    except tf.errors.DeadlineExceededError:
        leader = cluster.workers[0]
        raise ClusterNotFormed(
            f"the cluster did not form within --collective_timeout={collective_timeout:g} s: TensorFlow's "
            f"registration with the leader {leader[0]}:{leader[1]} at {leader[2]} timed out after every worker "
            "had answered the rendezvous (a worker that stopped in between); restart every worker"
        ) from None
    startup_signals.reclaim()  # TensorFlow's coordination agent took SIGTERM for a notifier of its own
    return Placement(
        strategy,
        "multi_worker_mirrored",
        tuple(gpus) or ("/cpu:0",),
        cluster.is_chief,
        task_type=cluster.task_type,
        task_id=cluster.task_index,
        num_workers=cluster.num_workers,
        cluster=cluster,
    )


def per_replica_batch(global_batch: int, num_replicas: int, accum_steps: int = 1) -> int:
    """The batch each replica sees; a global batch that does not split evenly (into replicas, and
    each replica's share into `accum_steps` micro-batches) is an error."""
    parts = num_replicas * accum_steps
    if global_batch % parts:
        into = f"the {num_replicas} replicas" + (
            f" x {accum_steps} micro-batches (--grad_accum_steps)" if accum_steps > 1 else ""
        )
        raise UserError(
            f"--global_batch={global_batch} is not divisible by {into}; "
            f"use a multiple of {parts} (e.g. {parts * max(1, global_batch // parts)})"
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
