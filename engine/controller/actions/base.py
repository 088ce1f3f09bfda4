"""The action interface: what an action sees (`ActionContext`) and its hooks (`Action`).

An action sees one frozen `ActionContext` per call, built by the trainer for that call: the step,
the config, the Task, the TensorBoard writers, whether this process is the chief, the last metrics
as read-only dicts, what earlier actions returned, and a few named callables (print a line, ask
for a stop or a checkpoint, run an evaluation, draw the evaluation's pictures, the weights to
export). It never sees the trainer. A hook RETURNS what it produces (metrics, paths, a record);
the trainer keeps a hook's non-None return under the action's `key`, shows it to the actions
after it (`context.outputs`) and in the run's result (`RunResult.action_outputs`).

Every worker calls every action (an action may run collectives, e.g. an evaluation or a checkpoint
write); chief-only work checks `context.is_chief`. A stop or a checkpoint asked for alike on every
worker happens on every worker at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable, ContextManager, Mapping, Optional

EMA_EVALUATION = "eval_ema"  # the key of the EMA evaluation's metrics in `outputs`


def _not_given(name: str) -> Callable:
    def missing(*args, **kwargs):
        raise RuntimeError(f"this ActionContext was built without {name}")

    return missing


def _read_only(mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping or {}))


def _empty() -> Mapping:
    return types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class ActionContext:
    """What one call of an action sees. Frozen, and its dicts are read-only copies, so an action
    can change nothing of the run except through the callables. A test builds one by hand with the
    fields its action reads (tests/test_actions.py)."""

    step: int  # global steps trained so far (the step this call is at)
    config: Any  # the run's frozen engine.config.Config
    task: Any = None  # the Task (its model, updater, export_model(), ...)
    is_chief: bool = True  # only the chief writes files; every worker runs every collective
    writers: Mapping[str, Any] = dataclasses.field(default_factory=_empty)  # "train", "eval"[, "eval_ema"]
    data_spec: Any = None  # the data's engine.data.spec.DataSpec (what the SavedModel's signature takes)
    checkpoint: Any = None  # the whole training state's tf.train.Checkpoint (to write a copy of it)
    train_metrics: Mapping[str, float] = dataclasses.field(default_factory=_empty)  # the last loop's
    loop_outputs: Mapping[str, Any] = dataclasses.field(default_factory=_empty)  # its raw tensors ("gradients")
    eval_metrics: Mapping[str, float] = dataclasses.field(default_factory=_empty)  # the last evaluation's
    outputs: Mapping[str, Any] = dataclasses.field(default_factory=_empty)  # actions' last returns, by key
    message: Callable[[str], None] = _not_given("message")  # a console line (shown on the chief only)
    request_stop: Callable[[str], None] = _not_given("request_stop")  # ends training at the next boundary
    request_save: Callable[[], None] = _not_given("request_save")  # a checkpoint of this step after the hook
    evaluate: Callable[[], tuple] = _not_given("evaluate")  # (metrics, line) of the current weights; collective
    write_eval_extras: Callable[[], None] = _not_given("write_eval_extras")  # pictures, Task.after_eval
    export_weights: Callable[[], ContextManager] = contextlib.nullcontext  # a block holding the weights to export

    def __post_init__(self):
        for name in ("writers", "train_metrics", "loop_outputs", "eval_metrics", "outputs"):
            object.__setattr__(self, name, _read_only(getattr(self, name)))

    @property
    def ema_metrics(self) -> Mapping[str, float]:
        """The last evaluation of the EMA weights (--ema_decay); empty without one."""
        return _read_only(self.outputs.get(EMA_EVALUATION))

    @property
    def selection_metrics(self) -> Mapping[str, float]:
        """What --best_metric and early stopping judge: the EMA weights' metrics when EMA is on."""
        return self.ema_metrics if self.config.ema_decay else self.eval_metrics


class Action:
    """Override the hooks you need; each runs on the host between compiled loops and may return
    what it produces (kept under `key`), or None."""

    name = "an action"  # how a failure names it: "<name> failed at step N: ..."

    @property
    def key(self) -> str:
        """Where the trainer keeps what a hook returns (`outputs`, `RunResult.action_outputs`)."""
        return type(self).__name__

    def resume_at(self, step: int) -> None:
        """Once, before training, with the step the run starts (or resumes) at."""

    def after_loop(self, context: ActionContext) -> Optional[Any]:
        """After each compiled loop (its scalars written, its checkpoint saved if one was due)."""

    def after_eval(self, context: ActionContext) -> Optional[Any]:
        """After each evaluation during training (`context.eval_metrics`: the raw weights')."""

    def at_end(self, context: ActionContext) -> Optional[Any]:
        """Once, after the last loop and the last evaluation (every worker)."""
