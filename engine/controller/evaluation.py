"""One evaluation of the whole test split, as the training job and the evaluation job both run it:
the reduced metrics (the Task's derived ones included) and the console line, which says when the
pipeline missed or repeated examples (invariant 9), and the warning line of an evaluation over
non-finite inputs or with a non-finite metric (the run goes on)."""

from __future__ import annotations

import math

from engine.loop import ratios


def evaluate_split(eval_loop, eval_data, task, num_test: int, step: int) -> tuple[dict, str]:
    """Runs the eval loop over the whole test split: ({metric: value}, the console line). The
    metrics include the Task's derived ones (e.g. perplexity from the per-token loss)."""
    result = eval_loop(eval_data)
    metrics, examples = ratios(result["totals"]), int(result["examples"].numpy())
    metrics.update(task.derived_metrics(metrics))
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
