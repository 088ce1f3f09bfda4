"""After each evaluation, on the chief with --summaries=full: the Task's own extras
(Task.after_eval) and, for classifiers, the confusion matrix and misclassified examples
(engine/observe/monitor.py draws them)."""

from __future__ import annotations

from engine.controller.actions.base import Action


class EvalSummaries(Action):
    name = "the evaluation's summaries (Task.after_eval, confusion matrix)"

    def after_eval(self, run, metrics: dict) -> None:
        run.monitor.after_eval(run.step)
        run.writers["eval"].flush()
