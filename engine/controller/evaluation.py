"""One evaluation of the whole test split, as the training job and the evaluation job both run it:
the reduced metrics (the Task's derived ones included) and the console line, which says when the
pipeline missed or repeated examples (invariant 9)."""

from __future__ import annotations

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
    return metrics, f"eval   step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f"  ({seen})"
