"""A Kubernetes JobSet (Kubeflow Trainer v2's TrainJob) as a cluster: TF_CONFIG built from the
JobSet's indexes, before TensorFlow loads.

deploy/trainer-runtime.yaml's ClusterTrainingRuntime runs the engine's workers as the pods of one
Indexed Job (the replicated job `node`, replicas 1) of a JobSet with DNS hostnames, so pod i is
reachable as `<jobset>-<replicated job>-<job index>-<i>.<subdomain>` (the subdomain is the JobSet's
name unless its network says otherwise). Kubernetes sets JOB_COMPLETION_INDEX (the pod index); the
runtime passes the pod's JobSet labels through the downward API as NAME_ENV (jobset-name),
REPLICATED_JOB_ENV (replicatedjob-name), JOB_INDEX_ENV (job-index) and RESTART_ENV (restart-attempt,
passed on as the engine's restart count). A pod sees nothing of the Job's size, so --num_workers
(the TrainJob's trainer.numNodes) says it. Worker i is pod i (worker 0 is the chief); every pod
listens on PORT_ENV (default DEFAULT_PORT: each pod has its own address). run.py then sets
TF_CONFIG, so validation, flag agreement, the watchdog and the stall detection are the same as for
a hand-written TF_CONFIG. With any other strategy, a pod other than pod 0 is refused (every pod
would train alone into the same --model_dir). No TensorFlow import here.
"""

from __future__ import annotations

import json
import re

from engine.distribute.launch import RESTARTS_ENV
from engine.errors import UserError

NAME_ENV = "JOBSET_NAME"
REPLICATED_JOB_ENV = "JOBSET_REPLICATED_JOB"
JOB_INDEX_ENV = "JOBSET_JOB_INDEX"
RESTART_ENV = "JOBSET_RESTART_ATTEMPT"
SUBDOMAIN_ENV = "JOBSET_SUBDOMAIN"  # only where the JobSet's network.subdomain is set
PORT_ENV = "CTL_WORKER_PORT"
DEFAULT_PORT = 2222
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # a DNS label (RFC 1123), at most 63 characters


def _index(env, name: str, text: str) -> int:
    value = env.get(name, "")
    if not value.isdigit():
        raise UserError(f"JobSet pod without a usable {name} ({value!r}): {text}; set TF_CONFIG yourself")
    return int(value)


def _dns_label(value: str, what: str) -> str:
    if len(value) > 63 or not _LABEL.fullmatch(value):
        raise UserError(
            f"JobSet {what} {value!r} is not a DNS label (lowercase letters, digits and '-', at most 63 "
            "characters), so the pods have no stable hostnames; shorten the TrainJob's name"
        )
    return value


def tf_config(env, num_workers: int) -> dict:
    """The TF_CONFIG dict of this pod of a JobSet of num_workers pods."""
    jobset, replicated = env.get(NAME_ENV, ""), env.get(REPLICATED_JOB_ENV, "")
    if not replicated:
        raise UserError(
            f"JobSet pod without {REPLICATED_JOB_ENV} (the label jobset.sigs.k8s.io/replicatedjob-name, "
            "through the downward API: see deploy/trainer-runtime.yaml); set TF_CONFIG yourself"
        )
    job_index = _index(env, JOB_INDEX_ENV, "the label jobset.sigs.k8s.io/job-index through the downward API")
    pod_index = _index(env, "JOB_COMPLETION_INDEX", "Kubernetes sets it in the pods of an Indexed Job")
    if job_index != 0:
        raise UserError(
            f"JobSet pod of job {job_index} of replicated job {replicated!r}: the engine's runtime runs "
            "one Job of every worker (replicas: 1, parallelism = completions = --num_workers)"
        )
    if pod_index >= num_workers:
        raise UserError(
            f"JobSet pod {pod_index} but --num_workers={num_workers}: give the TrainJob's "
            "trainer.numNodes and --num_workers the same value"
        )
    port = env.get(PORT_ENV, str(DEFAULT_PORT))
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"{PORT_ENV}={port!r} is no port (1 to 65535)")
    subdomain = env.get(SUBDOMAIN_ENV) or jobset
    prefix = f"{_dns_label(jobset, 'name')}-{replicated}-{job_index}"
    hosts = [_dns_label(f"{prefix}-{i}", "pod hostname") for i in range(num_workers)]
    own = env.get("HOSTNAME")
    if own and own != hosts[pod_index]:
        raise UserError(
            f"this pod's hostname is {own!r}, not {hosts[pod_index]!r}: the JobSet needs "
            "network.enableDNSHostnames: true (deploy/trainer-runtime.yaml sets it)"
        )
    workers = [f"{host}.{subdomain}:{port}" for host in hosts]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": pod_index}}


def configure(strategy: str, num_workers: int, env) -> dict:
    """For run.py, before TensorFlow loads: the variables to set for this JobSet pod (TF_CONFIG
    as a JSON string, and the restart count), or {} outside a JobSet or where TF_CONFIG is set.
    Raises UserError where the pod's variables and the flags do not fit together."""
    if env.get("TF_CONFIG") or not env.get(NAME_ENV):
        return {}
    if strategy != "multi_worker_mirrored":
        pod = env.get("JOB_COMPLETION_INDEX", "")
        if pod.isdigit() and int(pod) > 0:  # pod 0 cannot tell whether it is alone
            raise UserError(
                f"JobSet pod {pod} of --strategy={strategy}: every pod would train alone into the same "
                "--model_dir; use --strategy=multi_worker_mirrored, --num_workers=<trainer.numNodes>; or numNodes: 1"
            )
        return {}
    if num_workers < 1:
        raise UserError(
            f"JobSet pod ({NAME_ENV}={env[NAME_ENV]}) with --strategy=multi_worker_mirrored needs "
            "--num_workers=<the TrainJob's trainer.numNodes> (a pod cannot see how many pods its Job has)"
        )
    built = {"TF_CONFIG": json.dumps(tf_config(env, num_workers))}
    restarts = env.get(RESTART_ENV, "")
    if restarts.isdigit() and not env.get(RESTARTS_ENV):
        built[RESTARTS_ENV] = restarts
    return built
