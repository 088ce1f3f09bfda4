"""A Task with an action of its own (tests/test_actions.py)."""

from __future__ import annotations

from engine.controller.actions.base import Action
from engine.task import Task


class RecordingAction(Action):
    """Returns what it saw (after each loop: the step and loss; at the end: the keys of what the
    actions returned) and asks for a checkpoint at step 3, which no schedule would write."""

    name = "the recording action"

    def after_loop(self, context):
        if context.step == 3:
            context.request_save()
        return {"step": context.step, "loss": context.train_metrics["loss"]}

    def at_end(self, context):
        return {"step": context.step, "seen": sorted(context.outputs)}


class RecordingActionTask(Task):
    """A Task with an action of its own (RecordingAction)."""

    def actions(self):
        return [RecordingAction()]
