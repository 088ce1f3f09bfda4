"""TF_CONFIG, parsed and checked before any strategy exists.

A bad TF_CONFIG otherwise surfaces as a hang or a gRPC error minutes later; here each mistake is
one line naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import json
import re

from engine.errors import UserError

TASK_TYPES = ("chief", "worker")  # the training tasks: members of the collective group
EVALUATOR = "evaluator"  # a sidecar that evaluates checkpoints; never part of the collectives
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The cluster as TF_CONFIG describes it, and this process's place in it."""

    jobs: dict  # task type -> list of "host:port"
    task_type: str
    task_index: int

    @property
    def workers(self) -> list:
        """Every training task as (type, index, address), chief first: the collective's members."""
        return [(t, i, a) for t in TASK_TYPES for i, a in enumerate(self.jobs.get(t, []))]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def is_evaluator(self) -> bool:
        return self.task_type == EVALUATOR

    @property
    def has_evaluator(self) -> bool:
        """A sidecar evaluates the checkpoints: the workers then skip in-training evaluation."""
        return EVALUATOR in self.jobs

    @property
    def is_chief(self) -> bool:
        if self.is_evaluator:
            return False
        if "chief" in self.jobs:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def address(self) -> str:
        return self.jobs[self.task_type][self.task_index]

    def describe(self) -> str:
        role = "chief" if self.is_chief else "not chief"
        members = ", ".join(f"{t}:{i}={a}" for t, i, a in self.workers)
        return f"task {self.task_type}:{self.task_index} ({role}) of {self.num_workers} workers [{members}]"


def parse_tf_config(raw: str | None) -> Cluster:
    """Parses and validates a TF_CONFIG string; raises UserError naming the bad field."""
    if not raw or not raw.strip():
        raise UserError(
            "--strategy=multi_worker_mirrored needs TF_CONFIG (a JSON cluster spec) in the environment "
            "of every worker, or --num_workers=N to start N local workers; see docs/strategies.md, 'Several machines'"
        )
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(f"TF_CONFIG is not valid JSON ({err.msg} at character {err.pos}): {raw[:120]}") from None
    if not isinstance(spec, dict):
        raise UserError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got {type(spec).__name__}")
    for field in ("cluster", "task"):
        if field not in spec:
            raise UserError(f"TF_CONFIG has no {field!r} field (it needs 'cluster' and 'task')")
    jobs = _check_cluster(spec["cluster"])
    task = spec["task"]
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise UserError(f'TF_CONFIG \'task\' must be {{"type": ..., "index": ...}}, got {json.dumps(task)}')
    task_type, index = task["type"], task["index"]
    if task_type not in (*TASK_TYPES, EVALUATOR):
        raise UserError(
            f"TF_CONFIG task type {task_type!r} is not supported; valid: {', '.join((*TASK_TYPES, EVALUATOR))}"
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise UserError(f"TF_CONFIG task index must be an integer, got {json.dumps(index)}")
    if task_type not in jobs:
        raise UserError(
            f"TF_CONFIG task is {task_type}:{index} but the cluster has no {task_type!r} list "
            f"(it has {', '.join(sorted(jobs))})"
        )
    if not 0 <= index < len(jobs[task_type]):
        raise UserError(
            f"TF_CONFIG task index {index} is out of range: cluster {task_type!r} has "
            f"{len(jobs[task_type])} address(es), so valid indices are 0..{len(jobs[task_type]) - 1}"
        )
    return Cluster(jobs=jobs, task_type=task_type, task_index=index)


def _check_cluster(cluster) -> dict:
    if not isinstance(cluster, dict) or not cluster:
        raise UserError(
            f"TF_CONFIG 'cluster' must be a non-empty object of task type -> addresses, got {json.dumps(cluster)}"
        )
    unknown = sorted(set(cluster) - {*TASK_TYPES, EVALUATOR})
    if unknown:
        raise UserError(
            f"TF_CONFIG cluster has unsupported task type(s) {unknown}; valid: {', '.join((*TASK_TYPES, EVALUATOR))}"
        )
    for single in ("chief", EVALUATOR):
        if isinstance(cluster.get(single), list) and len(cluster[single]) > 1:
            raise UserError(f"TF_CONFIG cluster has {len(cluster[single])} {single} tasks; at most one is allowed")
    jobs, seen = {}, {}
    for task_type in (*TASK_TYPES, EVALUATOR):
        if task_type not in cluster:
            continue
        addresses = cluster[task_type]
        if not isinstance(addresses, list) or not addresses:
            raise UserError(
                f'TF_CONFIG cluster {task_type!r} must be a non-empty list of "host:port", got {json.dumps(addresses)}'
            )
        for i, address in enumerate(addresses):
            match = _ADDRESS.match(address) if isinstance(address, str) else None
            if not match or not 0 < int(match.group(2)) < 65536:
                raise UserError(
                    f'TF_CONFIG cluster {task_type}[{i}] = {json.dumps(address)} is not a "host:port" address'
                )
            if address in seen:
                raise UserError(f"TF_CONFIG address {address} appears twice ({seen[address]} and {task_type}[{i}])")
            seen[address] = f"{task_type}[{i}]"
        jobs[task_type] = list(addresses)
    if not set(jobs) & set(TASK_TYPES):
        raise UserError("TF_CONFIG cluster lists no 'worker' or 'chief' addresses")
    return jobs
