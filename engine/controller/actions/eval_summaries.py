"""After each evaluation, on the chief with --summaries=full: the Task's own extras
(Task.after_eval) and, for classifiers, the confusion matrix and misclassified examples
(engine/observe/monitor.py draws them; `context.write_eval_extras` is a no-op elsewhere)."""

from __future__ import annotations

from engine.controller.actions.base import Action, ActionContext


class EvalSummaries(Action):
    name = "the evaluation's summaries (Task.after_eval, confusion matrix)"

    def after_eval(self, context: ActionContext) -> None:
        context.write_eval_extras()
        context.writers["eval"].flush()
