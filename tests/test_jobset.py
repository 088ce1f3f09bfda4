"""Kubeflow Trainer v2's TrainJob (a JobSet) as a cluster (engine/distribute/jobset.py): the
TF_CONFIG built from a pod's JobSet indexes, the restart count passed on, the refusals as one line
(also through run.py, before TensorFlow loads). No cluster here: the pods' variables are those
deploy/trainer-runtime.yaml gives them (tests/test_deploy.py checks that runtime's env names)."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from helpers import REPO, TINY_FLAGS, run_cli

from engine import exit_codes
from engine.distribute import jobset
from engine.distribute.cluster import parse_tf_config
from engine.distribute.launch import RESTARTS_ENV
from engine.errors import UserError


def _pod_env(index: int = 1, **overrides) -> dict:
    """What the runtime's pod `index` of the TrainJob `ctl-mnist` sees."""
    env = {
        "JOBSET_NAME": "ctl-mnist",
        "JOBSET_REPLICATED_JOB": "node",
        "JOBSET_JOB_INDEX": "0",
        "JOB_COMPLETION_INDEX": str(index),
        "JOBSET_RESTART_ATTEMPT": "0",
        "CTL_WORKER_PORT": "2222",
        "HOSTNAME": f"ctl-mnist-node-0-{index}",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.fast
def test_a_pods_tf_config_names_every_pod_by_its_stable_hostname():
    built = jobset.configure("multi_worker_mirrored", 3, _pod_env(1, JOBSET_RESTART_ATTEMPT="2"))
    spec = json.loads(built["TF_CONFIG"])
    assert spec == {
        "cluster": {
            "worker": [
                "ctl-mnist-node-0-0.ctl-mnist:2222",
                "ctl-mnist-node-0-1.ctl-mnist:2222",
                "ctl-mnist-node-0-2.ctl-mnist:2222",
            ]
        },
        "task": {"type": "worker", "index": 1},
    }
    assert built[RESTARTS_ENV] == "2"  # the JobSet's restart attempt is the engine's restart count
    cluster = parse_tf_config(built["TF_CONFIG"])  # the engine's own TF_CONFIG checks accept it
    assert cluster.num_workers == 3 and cluster.task_index == 1
    chief = json.loads(jobset.configure("multi_worker_mirrored", 2, _pod_env(0, HOSTNAME=None))["TF_CONFIG"])
    assert chief["task"]["index"] == 0 and len(chief["cluster"]["worker"]) == 2


def test_the_subdomain_and_port_follow_the_runtime():
    env = _pod_env(0, JOBSET_SUBDOMAIN="workers", CTL_WORKER_PORT=None, JOBSET_RESTART_ATTEMPT=None)
    built = jobset.configure("multi_worker_mirrored", 2, env)
    assert json.loads(built["TF_CONFIG"])["cluster"]["worker"][1] == f"ctl-mnist-node-0-1.workers:{jobset.DEFAULT_PORT}"
    assert RESTARTS_ENV not in built


def test_outside_a_jobset_or_with_tf_config_nothing_is_built():
    assert jobset.configure("multi_worker_mirrored", 2, {}) == {}
    assert jobset.configure("multi_worker_mirrored", 2, _pod_env(0, TF_CONFIG='{"cluster": {}}')) == {}
    assert jobset.configure("mirrored", 0, _pod_env(0)) == {}  # one pod training alone
    with pytest.raises(UserError, match="every pod would train alone into the same --model_dir"):
        jobset.configure("mirrored", 0, _pod_env(1))  # a second pod: several trainings, one directory


@pytest.mark.parametrize(
    "num_workers, overrides, message",
    [
        (0, {}, "needs --num_workers=<the TrainJob's trainer.numNodes>"),
        (2, {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "ctl-mnist-node-0-2"}, "pod 2 but --num_workers=2"),
        (2, {"JOB_COMPLETION_INDEX": None}, "without a usable JOB_COMPLETION_INDEX"),
        (2, {"JOBSET_JOB_INDEX": "1", "HOSTNAME": None}, "one Job of every worker"),
        (2, {"JOBSET_REPLICATED_JOB": None}, "without JOBSET_REPLICATED_JOB"),
        (2, {"HOSTNAME": "ctl-mnist-node-0-1-x7k2p"}, "needs network.enableDNSHostnames: true"),
        (2, {"CTL_WORKER_PORT": "70000"}, "is no port"),
        (2, {"JOBSET_NAME": "Ctl_Mnist", "HOSTNAME": None}, "is not a DNS label"),
        (2, {"JOBSET_NAME": "x" * 60, "HOSTNAME": None}, "pod hostname .* is not a DNS label"),
    ],
)
def test_pods_that_do_not_fit_are_one_line(num_workers, overrides, message):
    with pytest.raises(UserError, match=message) as raised:
        jobset.configure("multi_worker_mirrored", num_workers, _pod_env(1, **overrides))
    assert "\n" not in str(raised.value)


def test_run_py_refuses_a_pod_beyond_num_workers_before_tensorflow_loads():
    result = run_cli(
        *TINY_FLAGS,
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--train_steps=2",
        "--model_dir=/nonexistent/never-written",
        env=_pod_env(2, HOSTNAME="ctl-mnist-node-0-2"),
        timeout=60,
    )
    assert result.returncode == exit_codes.BAD_INPUT.code, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: JobSet pod 2 but --num_workers=2: give the TrainJob's trainer.numNodes and --num_workers the same value"
    ]


def test_the_runtime_passes_the_variables_the_builder_reads():
    with open(os.path.join(REPO, "deploy", "trainer-runtime.yaml")) as f:
        runtime = yaml.safe_load(f)
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = node["template"]["spec"]["template"]["spec"]["containers"]
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", e.get("value")) for e in container["env"]
    }
    assert env == {
        jobset.NAME_ENV: "metadata.labels['jobset.sigs.k8s.io/jobset-name']",
        jobset.REPLICATED_JOB_ENV: "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']",
        jobset.JOB_INDEX_ENV: "metadata.labels['jobset.sigs.k8s.io/job-index']",
        jobset.RESTART_ENV: "metadata.labels['jobset.sigs.k8s.io/restart-attempt']",
        jobset.PORT_ENV: str(jobset.DEFAULT_PORT),
    }
    assert container["ports"] == [{"containerPort": jobset.DEFAULT_PORT}]
    assert node["replicas"] == 1 and node["template"]["spec"]["completionMode"] == "Indexed"
    assert runtime["spec"]["template"]["spec"]["network"]["enableDNSHostnames"] is True
