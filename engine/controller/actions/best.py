"""--best_metric: after each evaluation, model_dir/best/ keeps the whole training state and the
exported model of the best evaluation so far (engine/controller/best.py). With --ema_decay the
judged metric and the exported model are the EMA weights'; the checkpoint holds both."""

from __future__ import annotations

from engine.controller.actions.base import Action
from engine.controller.best import BestKeeper


class KeepBest(Action):
    name = "--best_metric's best checkpoint"

    def __init__(self, config, metric_names, is_chief: bool):
        # Built before training: a --best_metric the Task does not report is refused at once.
        self.keeper = BestKeeper(
            config.model_dir, config.best_metric, metric_names=tuple(metric_names), is_chief=is_chief
        )

    def after_eval(self, run, metrics: dict) -> None:
        kept = self.keeper.update(
            run.step,
            run.selection_metrics,
            run.state.checkpointer.checkpoint,
            run.task.model,
            save_model=run.save_model,
        )
        if kept:
            run.message(kept + (" (EMA weights)" if run.config.ema_decay else ""))

    def at_end(self, run) -> None:
        self.keeper.close()
