"""Host-side work the controller runs at known points of a run, as small action objects (the
pattern of Orbit's Controller + actions): the trainer calls every action's `after_loop` after
each compiled loop, `after_eval` after each evaluation and `at_end` once training is done, each
with a frozen ActionContext, and keeps what a hook returns; a failure in one ends the run in one
line and keeps the checkpoint written before it (invariant 12).

  base.py            ActionContext (what an action sees) and Action (the three hooks);
                     `engine_actions` below: the engine's, in order
  histograms.py      weight and gradient histograms (--histogram_every)
  eval_summaries.py  the evaluation's pictures (confusion matrix, misclassified) and Task.after_eval
  ema_eval.py        evaluation of the EMA weights (--ema_decay), logged as eval_ema/
  best.py            keeps model_dir/best/ (--best_metric)
  early_stopping.py  ends training cleanly when --best_metric stops improving
  export.py          export/model.keras and export/saved_model/<step>/ (--export_formats)

A Task adds its own by returning them from `Task.actions()`.
"""

from __future__ import annotations

from engine.controller.actions.best import KeepBest
from engine.controller.actions.early_stopping import EarlyStopping
from engine.controller.actions.ema_eval import EmaEvaluation
from engine.controller.actions.eval_summaries import EvalSummaries
from engine.controller.actions.export import Export
from engine.controller.actions.histograms import Histograms
from engine.controller.evaluation import metric_names


def engine_actions(config, task, *, is_chief: bool) -> list:
    """The engine's own actions for this run, in order: EMA evaluation before best and early
    stopping (which judge its metrics), export last; the Task's own actions after them."""
    actions = [Histograms(), EvalSummaries()]
    if config.ema_decay:
        actions.append(EmaEvaluation())
    if config.best_metric:
        actions.append(KeepBest(config, metric_names(task), is_chief))
    if config.early_stopping_patience:
        actions.append(EarlyStopping(config, metric_names(task), is_chief))
    if config.export:
        actions.append(Export(config))
    return actions + list(task.actions())
