"""--best_metric: after each evaluation, model_dir/best/ keeps the whole training state and the
exported model of the best evaluation so far (engine/controller/best.py). With --ema_decay the
judged metric and the exported model are the EMA weights'; the checkpoint holds both."""

from __future__ import annotations

from engine.controller.actions.base import Action, ActionContext
from engine.controller.best import BestKeeper


class KeepBest(Action):
    name = "--best_metric's best checkpoint"
    key = "best"

    def __init__(self, config, metric_names, is_chief: bool):
        # Built before training: a --best_metric the Task does not report is refused at once.
        self.keeper = BestKeeper(
            config.model_dir, config.best_metric, metric_names=tuple(metric_names), is_chief=is_chief
        )

    def after_eval(self, context: ActionContext) -> dict | None:
        """The best record (best.json's fields) when this evaluation became the best, else None."""

        def save_model(path):
            with context.export_weights():
                context.task.export_model().save(path)

        kept = self.keeper.update(
            context.step, context.selection_metrics, context.checkpoint, context.task.model, save_model=save_model
        )
        if not kept:
            return None
        context.message(kept + (" (EMA weights)" if context.config.ema_decay else ""))
        return dict(self.keeper.record)

    def at_end(self, context: ActionContext) -> None:
        self.keeper.close()
