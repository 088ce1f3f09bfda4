"""One exit-code table (engine/exit_codes.py, invariant 13): the errors, the docs and the deploy/
manifests use exactly its codes, and every code a restart can cure is >= 128 and no signal's."""

from __future__ import annotations

import os

import pytest
import yaml
from helpers import REPO

from engine import errors, exit_codes

pytestmark = pytest.mark.fast


def _load(name):
    with open(os.path.join(REPO, "deploy", name)) as f:
        return yaml.safe_load(f)


def test_retryable_codes_are_at_least_128_and_no_signal_code():
    assert exit_codes.RETRYABLE and all(c >= 128 and c not in exit_codes.SIGNAL_CODES for c in exit_codes.RETRYABLE)
    assert exit_codes.PERMANENT and all(0 < c < 128 for c in exit_codes.PERMANENT)
    assert len({c.code for c in exit_codes.CODES}) == len(exit_codes.CODES)
    assert exit_codes.retryable(137) and exit_codes.retryable(-9) and not exit_codes.retryable(2)


def test_the_errors_exit_with_the_tables_codes():
    assert errors.UserError.exit_code == exit_codes.BAD_INPUT.code
    assert errors.NonFiniteLoss.exit_code == exit_codes.NON_FINITE.code
    assert errors.StorageFailed.exit_code == exit_codes.STORAGE_FAILED.code
    assert errors.Preempted.exit_code == exit_codes.PREEMPTED.code
    assert errors.ExtraFailed.exit_code == exit_codes.BUG.code
    assert errors.Stalled.exit_code == exit_codes.STALLED.code
    assert errors.PeerLost.exit_code == exit_codes.PEER_LOST.code


def test_the_docs_table_is_the_modules():
    with open(os.path.join(REPO, "docs", "failures.md")) as f:
        assert exit_codes.markdown_table() in f.read(), (
            "regenerate docs/failures.md's table: exit_codes.markdown_table()"
        )


def test_the_indexed_job_fails_on_permanent_codes_and_retries_the_others():
    rules = _load("indexed-job.yaml")["spec"]["podFailurePolicy"]["rules"]
    by_action = {}
    for rule in rules:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["operator"] == "In"
            by_action.setdefault(rule["action"], set()).update(rule["onExitCodes"]["values"])
    assert by_action == {"FailJob": set(exit_codes.PERMANENT), "Ignore": set(exit_codes.RETRYABLE)}


def test_the_tfjob_restarts_by_exit_code_with_the_tables_codes():
    worker = _load("kubeflow-tfjob.yaml")["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"  # Kubeflow: >= 128 restarts, 1/2/126/127 are permanent
    notes = worker["template"]["metadata"]["annotations"]
    assert {int(c) for c in notes["ctl-engine/permanent-exit-codes"].split(",")} == set(exit_codes.PERMANENT)
    assert {int(c) for c in notes["ctl-engine/retryable-exit-codes"].split(",")} == set(exit_codes.RETRYABLE)


def test_the_trainer_runtime_fails_on_permanent_codes_and_restarts_the_jobset_on_the_others():
    """deploy/trainer-runtime.yaml: a permanent code fails the Job by its podFailurePolicy (reason
    PodFailurePolicy), which fails the JobSet; a retryable one is counted against backoffLimit 0
    (reason BackoffLimitExceeded), which restarts every worker."""
    jobset = _load("trainer-runtime.yaml")["spec"]["template"]["spec"]
    (node,) = jobset["replicatedJobs"]
    job = node["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    by_action = {}
    for rule in job["podFailurePolicy"]["rules"]:
        assert rule["onExitCodes"]["operator"] == "In" and rule["onExitCodes"]["containerName"] == container["name"]
        by_action.setdefault(rule["action"], set()).update(rule["onExitCodes"]["values"])
    assert by_action == {"FailJob": set(exit_codes.PERMANENT), "Count": set(exit_codes.RETRYABLE)}
    reasons = {r["action"]: r["onJobFailureReasons"] for r in jobset["failurePolicy"]["rules"]}
    assert reasons == {"FailJobSet": ["PodFailurePolicy"], "RestartJobSet": ["BackoffLimitExceeded"]}
    assert jobset["failurePolicy"]["maxRestarts"] > 0
