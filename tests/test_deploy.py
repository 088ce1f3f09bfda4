"""Every manifest in deploy/ is validated offline (docs/strategies.md#kubernetes).

Core Kubernetes types (the Indexed Job) are validated whole against Kubernetes' own schemas by
the kubernetes-validate package, strictly (an unknown field is an error). A custom resource has
no schema there: each Job or pod template embedded in it is validated the same way (as a Job,
and as a PodTemplate), and every other field it uses must be one of CRD_FIELDS, the paths (and
enum values) read from the upstream CRDs: Kubeflow Trainer's ClusterTrainingRuntime and TrainJob
(kubeflow/trainer manifests/base/crds at 8c0f5059bd51, trainer.kubeflow.org/v1alpha1; its JobSet
part is jobset.x-k8s.io/v1alpha2's JobSetSpec) and the Training Operator's TFJob (kubeflow/trainer
release-1.9 at 289f17906, kubeflow.org/v1). Exit codes: tests/test_exit_codes.py."""

from __future__ import annotations

import copy
import glob
import os

import kubernetes_validate
import pytest
import yaml
from helpers import REPO

KUBERNETES = "1.35.0"  # the schemas' version (kubernetes-validate ships one per release)

# {(apiVersion, kind): {path: allowed values or None (any)}}: the CRD fields deploy/ may use
# outside the embedded templates; `[]` is a list item, `*` a map value.
CRD_FIELDS = {
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): {
        "metadata.name": None,
        "spec.mlPolicy.numNodes": None,
        "spec.template.spec.network.enableDNSHostnames": (True, False),
        "spec.template.spec.network.subdomain": None,
        "spec.template.spec.failurePolicy.maxRestarts": None,
        "spec.template.spec.failurePolicy.rules[].name": None,
        "spec.template.spec.failurePolicy.rules[].action": (
            "FailJobSet",
            "RestartJobSet",
            "RestartJobSetAndIgnoreMaxRestarts",
            "RestartJob",
            "RestartJobAndIgnoreMaxRestarts",
        ),
        "spec.template.spec.failurePolicy.rules[].onJobFailureReasons[]": (  # the JobSet webhook's list
            "BackoffLimitExceeded",
            "DeadlineExceeded",
            "FailedIndexes",
            "MaxFailedIndexesExceeded",
            "PodFailurePolicy",
        ),
        "spec.template.spec.replicatedJobs[].name": None,
        "spec.template.spec.replicatedJobs[].replicas": None,
    },
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): {
        "metadata.name": None,
        "spec.runtimeRef.name": None,
        "spec.runtimeRef.apiGroup": ("trainer.kubeflow.org",),
        "spec.runtimeRef.kind": ("ClusterTrainingRuntime", "TrainingRuntime"),
        "spec.trainer.image": None,
        "spec.trainer.numNodes": None,
        "spec.trainer.args[]": None,
        "spec.trainer.command[]": None,
    },
    ("kubeflow.org/v1", "TFJob"): {
        "metadata.name": None,
        "spec.runPolicy.backoffLimit": None,
        "spec.tfReplicaSpecs.*.replicas": None,
        "spec.tfReplicaSpecs.*.restartPolicy": ("Always", "OnFailure", "Never", "ExitCode"),
    },
}
# Where each custom resource embeds core templates: (path, the core kind it is validated as).
EMBEDDED = {
    "ClusterTrainingRuntime": [("spec.template.spec.replicatedJobs[].template", "Job")],
    "TrainJob": [],
    "TFJob": [("spec.tfReplicaSpecs.*.template", "PodTemplate")],
}


def _manifests() -> list:
    return sorted(glob.glob(os.path.join(REPO, "deploy", "*.yaml")))


def _load(path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _leaves(value, path="", skip=()):
    """(path, value) of every leaf of a parsed manifest, not descending into the paths `skip`."""
    if path in skip:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            is_map = path.endswith("tfReplicaSpecs")  # TFJob: replica type -> spec
            yield from _leaves(child, f"{path}.{'*' if is_map else key}".lstrip("."), skip)
    elif isinstance(value, list):
        for child in value:
            yield from _leaves(child, f"{path}[]", skip)
    else:
        yield path, value


def _at(value, path: str) -> list:
    """Every value at `path` (with its [] and * steps)."""
    found = [value]
    for step in path.split("."):
        name, is_list = step.removesuffix("[]"), step.endswith("[]")
        found = [
            v for parent in found for v in (parent.values() if name == "*" else [parent.get(name)]) if v is not None
        ]
        if is_list:
            found = [item for items in found for item in items]
    return found


def _as_core(template: dict, kind: str) -> list:
    """A core object for each embedded template: the Job itself, and its pod template."""
    if kind == "Job":
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "embedded"}, **template}
        return [job, *_as_core(template["spec"]["template"], "PodTemplate")]
    return [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "embedded"}, "template": template}]


def check(manifest: dict) -> list:
    """Validates one manifest; returns the core objects it validated (raises on a problem)."""
    kind = manifest["kind"]
    key = (manifest["apiVersion"], kind)
    if key not in CRD_FIELDS:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
        return [manifest]
    embedded = EMBEDDED[kind]
    fields = CRD_FIELDS[key]
    for path, value in _leaves(manifest, skip={p for p, _ in embedded}):
        if path in ("apiVersion", "kind"):
            continue
        assert path in fields, f"{kind}: {path} is not a field of the upstream CRD (or not checked here)"
        allowed = fields[path]
        assert allowed is None or value in allowed, f"{kind}: {path}={value!r} is not one of {allowed}"
    validated = []
    for path, core_kind in embedded:
        templates = _at(manifest, path)
        assert templates, f"{kind}: no template at {path}"
        for template in templates:
            for core in _as_core(template, core_kind):
                kubernetes_validate.validate(core, KUBERNETES, strict=True)
                validated.append(core)
    return validated


@pytest.mark.fast
@pytest.mark.parametrize("path", _manifests(), ids=os.path.basename)
def test_every_manifest_validates(path):
    manifest = _load(path)
    validated = check(manifest)
    assert len(validated) >= (len(EMBEDDED[manifest["kind"]]) if manifest["kind"] in EMBEDDED else 1)


def test_deploy_holds_only_checked_files():
    names = sorted(os.listdir(os.path.join(REPO, "deploy")))
    assert names == sorted([*map(os.path.basename, _manifests()), "slurm.sbatch"])  # the batch script: test_slurm
    kinds = {_load(path)["kind"] for path in _manifests()}
    assert kinds == {"Job", "TFJob", "ClusterTrainingRuntime", "TrainJob"}


def test_the_trainjob_references_the_runtime():
    runtime, job = (
        _load(os.path.join(REPO, "deploy", "trainer-runtime.yaml")),
        _load(os.path.join(REPO, "deploy", "trainjob.yaml")),
    )
    assert job["spec"]["runtimeRef"] == {
        "name": runtime["metadata"]["name"],
        "apiGroup": "trainer.kubeflow.org",
        "kind": runtime["kind"],
    }
    workers = [a for a in job["spec"]["trainer"]["args"] if a.startswith("--num_workers=")]
    assert workers == [f"--num_workers={job['spec']['trainer']['numNodes']}"]  # a pod cannot see its Job's size
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    labels = node["template"]["metadata"]["labels"]
    assert labels["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"  # where trainer.numNodes goes
    (container,) = node["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node"  # the container spec.trainer's image and args replace


@pytest.mark.parametrize(
    "name, path, value, error",
    [
        ("indexed-job.yaml", ("spec", "completionz"), 2, kubernetes_validate.ValidationError),
        ("trainer-runtime.yaml", ("spec", "template", "spec", "failurePolicy", "maxRestart"), 3, AssertionError),
        (
            "trainer-runtime.yaml",
            ("spec", "template", "spec", "failurePolicy", "rules", 0, "action"),
            "Retry",
            AssertionError,
        ),
        ("trainjob.yaml", ("spec", "trainer", "numNode"), 2, AssertionError),
        (
            "kubeflow-tfjob.yaml",
            ("spec", "tfReplicaSpecs", "Worker", "template", "spec", "containers", 0, "comand"),
            [],
            kubernetes_validate.ValidationError,
        ),
        (
            "trainer-runtime.yaml",
            ("spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "backofLimit"),
            0,
            kubernetes_validate.ValidationError,
        ),
    ],
)
def test_a_wrong_field_is_caught(name, path, value, error):
    manifest = copy.deepcopy(_load(os.path.join(REPO, "deploy", name)))
    parent = manifest
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    with pytest.raises(error):
        check(manifest)
