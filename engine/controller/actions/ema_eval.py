"""--ema_decay: after each evaluation of the trained weights, the same evaluation of their moving
average (engine/ema.py), logged to the eval_ema/ TensorBoard run with the same tags, so the two
curves share a chart. Best-checkpoint tracking, early stopping and the export then use the EMA
weights (run.selection_metrics). Every worker runs it (the evaluation is a collective)."""

from __future__ import annotations

from engine.controller.actions.base import Action
from engine.controller.evaluation import evaluate_split


class EmaEvaluation(Action):
    name = "the evaluation of the EMA weights"

    def after_eval(self, run, metrics: dict) -> None:
        with run.task.updater.ema.swapped():
            ema_metrics, line = evaluate_split(run.eval_loop, run.eval_data, run.task, run.data.num_test, run.step)
        run.writers["eval_ema"].write_scalars(run.step, ema_metrics)
        run.writers["eval_ema"].flush()
        run.ema_metrics = ema_metrics
        run.message(
            line.replace("eval ", "eval (EMA weights) ", 1) if line.startswith("eval ") else f"{line} (EMA weights)"
        )
