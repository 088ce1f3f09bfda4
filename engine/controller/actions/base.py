"""The action interface.

An action sees the run (engine/controller/trainer.py `_Run`): `run.config`, `run.task`,
`run.state` (checkpointer, counters), `run.writers` (TensorBoard), `run.placement` (is_chief),
`run.step`, `run.message(line)` (console, chief only), `run.eval_metrics` / `run.ema_metrics`,
`run.selection_metrics` (what best and early stopping judge: the EMA evaluation's when EMA is on)
and `run.request_stop(reason)` (training ends cleanly at the next loop boundary, on every worker
alike when every worker's action decides alike).

Every worker calls every action (an action may run collectives, e.g. an evaluation or a checkpoint
write); chief-only work checks `run.placement.is_chief`.
"""

from __future__ import annotations


class Action:
    """Override the hooks you need; each runs on the host between compiled loops."""

    name = "an action"  # how a failure names it: "<name> failed at step N: ..."

    def resume_at(self, step: int) -> None:
        """Once, before training, with the step the run starts (or resumes) at."""

    def after_loop(self, run) -> None:
        """After each compiled loop (its scalars written, its checkpoint saved if one was due)."""

    def after_eval(self, run, metrics: dict) -> None:
        """After each evaluation during training (`metrics`: the raw weights' eval metrics)."""

    def at_end(self, run) -> None:
        """Once, after the last loop and the last evaluation (every worker)."""
