"""One evaluation of the whole test split, as the training job and the evaluation job both run it:
the reduced metrics (the Task's derived ones and its whole-set `eval_summary` included) and the
console line, which says when the pipeline missed or repeated examples (invariant 9), and the
warning line of an evaluation over non-finite inputs or with a non-finite metric (the run goes on)."""

from __future__ import annotations

import math
import numbers
import os

import numpy as np

from engine import user_code
from engine.errors import UserError
from engine.loop import ratios, several_workers
from engine.task import Task


def summarises(task) -> bool:
    """The Task computes whole-eval-set metrics (overrides eval_summary or declares their names)."""
    return type(task).eval_summary is not Task.eval_summary or bool(task.eval_summary_metrics)


def metric_names(task) -> tuple:
    """Every eval metric a run can keep the best of or stop early on: eval_step's, then eval_summary's."""
    return tuple(task.eval_metrics) + tuple(task.eval_summary_metrics)


def check_collect(strategy, task, evaluates: bool) -> None:
    """At start-up: a Task with an eval_summary that a multi-worker run would evaluate is refused
    in one line (each worker holds only its shard of the eval set)."""
    if evaluates and summarises(task) and several_workers(strategy):
        raise UserError(
            f"{type(task).__name__}.eval_summary (whole-eval-set metrics from self.collect) needs every "
            "eval example in one process, which training on several workers does not have; train with "
            "--eval_every=-1 and evaluate with a sidecar (--evaluator) or --mode=eval"
        )
    clash = set(task.eval_summary_metrics) & set(task.eval_metrics)
    if clash:
        raise UserError(
            f"{type(task).__name__}: {', '.join(sorted(clash))} is in both eval_metrics and "
            "eval_summary_metrics; give eval_summary's metrics names of their own"
        )


def check_collection_fits(collected: dict, examples: int, num_test: int, available_bytes: int) -> None:
    """Before training (the preflight, from one batch's collection of `examples` rows): the whole
    test split's collection, held twice at the end of an evaluation (the buffer and its NumPy
    copy), must fit in `available_bytes` of host memory; else one line."""
    if not collected or not examples:
        return
    per_example = sum(rows.nbytes for rows in collected.values()) / examples
    needed = 2 * per_example * num_test
    if needed > available_bytes:
        names = ", ".join(f"{name} {rows.shape[1:]} {rows.dtype}" for name, rows in collected.items())
        raise UserError(
            f"eval_step collects {per_example:,.0f} bytes per example ({names}): the {num_test:,} test "
            f"examples need {needed / 2**30:.1f} GiB of host memory at each evaluation (the buffer and its "
            f"NumPy copy), more than the {available_bytes / 2**30:.1f} GiB available; collect less per "
            "example (e.g. the top-k scores, not every class's) or evaluate a smaller test split"
        )


def available_host_memory() -> int:
    """Bytes of host memory available now (Linux: MemAvailable; elsewhere all physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _summary(task, collected: dict, examples: int) -> dict:
    """Task.eval_summary's scalars as floats, its input and output checked (one line each)."""
    for name, rows in collected.items():
        if len(rows) != examples:
            raise UserError(
                f"eval_step's self.collect({name!r}, ...) gave {len(rows)} rows for {examples} eval "
                "examples; its leading axis must be the examples of the replica's batch"
            )
    with user_code.host_errors_named(f"{type(task).__name__}.eval_summary"):
        returned = task.eval_summary(collected)
    if not isinstance(returned, dict):
        raise UserError(f"{type(task).__name__}.eval_summary returned {type(returned).__name__}, not a dict")
    declared = tuple(task.eval_summary_metrics)
    if declared and sorted(returned) != sorted(declared):
        raise UserError(
            f"{type(task).__name__}.eval_summary returned {sorted(returned)}; eval_summary_metrics "
            f"declares {sorted(declared)}"
        )
    summary = {}
    for name, value in returned.items():
        if name in task.eval_metrics:
            raise UserError(f"{type(task).__name__}.eval_summary returned {name!r}, which eval_step's metrics hold")
        array = np.asarray(value)
        if array.shape != () or not isinstance(array.item(), numbers.Real):
            raise UserError(
                f"{type(task).__name__}.eval_summary returned {name!r} of shape {array.shape}, not one "
                "number; return one scalar per name"
            )
        summary[name] = float(array)
    return summary


def evaluate_split(eval_loop, eval_data, task, num_test: int, step: int, *, preflight=False) -> tuple[dict, str]:
    """Runs the eval loop over the whole test split: ({metric: value}, the console line). The
    metrics include the Task's derived ones (e.g. perplexity from the per-token loss) and its
    eval_summary's (from what eval_step collected). preflight: eval_data is a first batch only
    (the preflight's), whose collection must scale to the whole split in host memory."""
    result = eval_loop(eval_data)
    metrics, examples = ratios(result["totals"]), int(result["examples"].numpy())
    with user_code.host_errors_named(f"{type(task).__name__}.derived_metrics"):
        metrics.update(task.derived_metrics(metrics))
    collected = {name: value.numpy() for name, value in result.get("collected", {}).items()}
    if preflight:
        check_collection_fits(collected, examples, num_test, available_host_memory())
    if collected or summarises(task):
        metrics.update(_summary(task, collected, examples))
    seen = (
        f"{examples} examples"
        if examples == num_test
        else (f"{examples} examples evaluated, but the test split has {num_test}: its pipeline missed or repeated some")
    )
    line = f"eval   step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f"  ({seen})"
    warning = nonfinite_warning(result, step)
    return metrics, line + (f"\n{warning}" if warning else "")


def nonfinite_warning(result, step: int) -> str:
    """One warning line when the evaluation at `step` met NaN/Inf inputs or summed a non-finite
    metric (its total: a metric without counts is no NaN), naming each; "" when all is finite."""
    bad_inputs = int(result["nonfinite_examples"].numpy()) if "nonfinite_examples" in result else 0
    totals = {name: float(total) for name, (total, _) in result["totals"].items()}
    bad_metrics = [f"{name} {total}" for name, total in totals.items() if not math.isfinite(total)]
    parts = [f"{bad_inputs} test examples hold NaN or Inf inputs"] if bad_inputs else []
    parts += [f"non-finite metric {', '.join(bad_metrics)}"] if bad_metrics else []
    if not parts:
        return ""
    what = "; ".join(parts)
    return (
        f"warning      eval step {step}: {what}: this evaluation's metrics are not to be trusted; check the test data"
    )
