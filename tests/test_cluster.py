"""TF_CONFIG validation: each mistake is one line naming the field and the value."""

from __future__ import annotations

import json
import time

import pytest

from helpers import run_cli
from engine.distribute.cluster import parse_tf_config
from engine.errors import UserError


GOOD = {"cluster": {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}, "task": {"type": "worker", "index": 1}}

BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"task": GOOD["task"]}), "no 'cluster'"),
    (json.dumps({"cluster": GOOD["cluster"]}), "no 'task'"),
    (json.dumps({**GOOD, "task": {"type": "ps", "index": 0}}), "'ps' is not supported"),
    (json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}), "index 2 is out of range"),
    (json.dumps({**GOOD, "task": {"type": "worker", "index": "1"}}), "must be an integer"),
    (json.dumps({**GOOD, "task": {"type": "chief", "index": 0}}), "has no 'chief' list"),
    (json.dumps({**GOOD, "cluster": {"worker": ["127.0.0.1:2001", "127.0.0.1:2001"]}}), "appears twice"),
    (json.dumps({**GOOD, "cluster": {"worker": ["127.0.0.1", "127.0.0.1:2002"]}}), 'is not a "host:port"'),
    (json.dumps({**GOOD, "cluster": {"worker": ["127.0.0.1:2001", "host:99999"]}}), 'is not a "host:port"'),
    (json.dumps({**GOOD, "cluster": {"worker": []}}), "non-empty list"),
    (json.dumps({**GOOD, "cluster": {"worker": ["a:1"], "ps": ["b:2"]}}), "unsupported task type"),
    (json.dumps({**GOOD, "cluster": {"worker": ["a:1"], "evaluator": ["b:2", "c:3"]}}), "2 evaluator tasks"),
    (
        json.dumps({"cluster": {"evaluator": ["b:2"]}, "task": {"type": "evaluator", "index": 0}}),
        "no 'worker' or 'chief'",
    ),
]


def test_good_config():
    cluster = parse_tf_config(json.dumps(GOOD))
    assert (cluster.task_type, cluster.task_index, cluster.num_workers, cluster.is_chief) == ("worker", 1, 2, False)
    with_chief = parse_tf_config(
        json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]}, "task": {"type": "chief", "index": 0}})
    )
    assert with_chief.is_chief and [w[0] for w in with_chief.workers] == ["chief", "worker"]


@pytest.mark.fast
def test_evaluator_task_is_not_a_worker():
    """The sidecar evaluator is in TF_CONFIG but not in the collective group, and never the chief."""
    cluster = {"worker": ["a:1", "b:2"], "evaluator": ["c:3"]}
    evaluator = parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}}))
    assert evaluator.is_evaluator and not evaluator.is_chief and evaluator.has_evaluator
    assert [w[2] for w in evaluator.workers] == ["a:1", "b:2"] and evaluator.num_workers == 2
    chief = parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    assert chief.is_chief and chief.has_evaluator and not chief.is_evaluator


@pytest.mark.parametrize("raw, message", BAD, ids=[m for _, m in BAD])
def test_bad_config(raw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as info:
        parse_tf_config(raw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("raw, message", [BAD[5], BAD[8]], ids=["index", "duplicate"])
def test_run_py_rejects_bad_tf_config_within_seconds(raw, message):
    started = time.monotonic()
    result = run_cli("--strategy=multi_worker_mirrored", "--dataset=synthetic", env={"TF_CONFIG": raw}, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
    assert time.monotonic() - started < 20
