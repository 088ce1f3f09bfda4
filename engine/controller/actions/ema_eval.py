"""--ema_decay: after each evaluation of the trained weights, the same evaluation of their moving
average (engine/ema.py), logged to the eval_ema/ TensorBoard run with the same tags, so the two
curves share a chart. It returns the metrics (kept as `outputs["eval_ema"]`), which best-checkpoint
tracking, early stopping and the export then judge (`context.selection_metrics`). Every worker runs
it (the evaluation is a collective)."""

from __future__ import annotations

from engine.controller.actions.base import EMA_EVALUATION, Action, ActionContext


class EmaEvaluation(Action):
    name = "the evaluation of the EMA weights"
    key = EMA_EVALUATION

    def after_eval(self, context: ActionContext) -> dict:
        with context.task.updater.ema.swapped():
            ema_metrics, line = context.evaluate()
        context.writers["eval_ema"].write_scalars(context.step, ema_metrics)
        context.writers["eval_ema"].flush()
        context.message(
            line.replace("eval ", "eval (EMA weights) ", 1) if line.startswith("eval ") else f"{line} (EMA weights)"
        )
        return ema_metrics
