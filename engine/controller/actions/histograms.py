"""Weight and gradient histograms every --histogram_every steps (chief only; the loops are cut to
land on those steps by engine/controller/schedule.py)."""

from __future__ import annotations

from engine.controller.actions.base import Action, ActionContext


class Histograms(Action):
    name = "the histograms"

    def after_loop(self, context: ActionContext) -> None:
        every = context.config.histogram_every
        if not (context.is_chief and every and context.step % every == 0):
            return
        variables = context.task.model.trainable_variables
        histograms = {f"weights/{v.path}": v.numpy() for v in variables}
        gradients = context.loop_outputs.get("gradients")
        if gradients is not None:
            histograms.update({f"gradients/{v.path}": g.numpy() for v, g in zip(variables, gradients)})
        context.writers["train"].write_histograms(context.step, histograms)
