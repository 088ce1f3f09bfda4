"""Weight and gradient histograms every --histogram_every steps (chief only; the loops are cut to
land on those steps by engine/controller/schedule.py)."""

from __future__ import annotations

from engine.controller.actions.base import Action


class Histograms(Action):
    name = "the histograms"

    def after_loop(self, run) -> None:
        every = run.config.histogram_every
        if not (run.placement.is_chief and every and run.step % every == 0):
            return
        variables = run.task.model.trainable_variables
        histograms = {f"weights/{v.path}": v.numpy() for v in variables}
        gradients = run.last_result.get("gradients") if run.last_result else None
        if gradients is not None:
            histograms.update({f"gradients/{v.path}": g.numpy() for v, g in zip(variables, gradients)})
        run.writers["train"].write_histograms(run.step, histograms)
