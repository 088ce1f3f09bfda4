"""--early_stopping_patience=N: training ends cleanly (exit 0, final checkpoint, one line naming
the step and the best value) after N evaluations in a row in which --best_metric did not improve
on the best so far by at least --early_stopping_min_delta.

The decision is taken from the evaluation's metrics, which are all-reduced, so every worker
decides alike at the same evaluation and stops at the same step with no extra collective.
What the count was after each evaluation is kept in model_dir/early_stopping.json by step, so a
resumed run takes up the count of the evaluation its checkpoint follows (exact on resume).
"""

from __future__ import annotations

import json
import math
import os

from engine.controller.actions.base import Action, ActionContext
from engine.controller.best import parse_best_metric
from engine.errors import UserError

FILE_NAME = "early_stopping.json"


class EarlyStopping(Action):
    name = "early stopping"

    def __init__(self, config, metric_names, is_chief: bool):
        if not config.best_metric:
            raise UserError(
                f"--early_stopping_patience={config.early_stopping_patience} needs --best_metric (the "
                "metric whose improvement it waits for), e.g. --best_metric=accuracy"
            )
        self.metric, self.higher_is_better = parse_best_metric(config.best_metric)
        if self.metric not in metric_names:
            raise UserError(
                f"--best_metric={config.best_metric}: the task's eval metrics are "
                f"{', '.join(metric_names)}; there is no {self.metric!r} (eval_summary's count once "
                "listed in eval_summary_metrics)"
            )
        self.patience, self.min_delta = config.early_stopping_patience, config.early_stopping_min_delta
        self.path = os.path.join(config.model_dir, FILE_NAME)
        self.is_chief = is_chief
        self.history = self._read()  # [{"step", "best", "waited"}], one per evaluation
        self.best, self.waited = None, 0

    def _read(self) -> list:
        try:
            with open(self.path) as f:
                return json.load(f)["history"]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"cannot read {self.path} ({err}); fix or delete it") from None

    def resume_at(self, step: int) -> None:
        """The count and best value of the last evaluation at or before `step` (a resumed run's)."""
        self.history = [entry for entry in self.history if entry["step"] <= step]
        if self.history:
            self.best, self.waited = self.history[-1]["best"], self.history[-1]["waited"]

    def improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        gain = value - self.best if self.higher_is_better else self.best - value
        return gain >= self.min_delta and gain > 0

    def after_eval(self, context: ActionContext) -> None:
        step = context.step
        value = float(context.selection_metrics[self.metric])
        if self.improved(value):
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        self.history = [e for e in self.history if e["step"] < step] + [
            {"step": step, "best": self.best, "waited": self.waited}
        ]
        stop = self.waited >= self.patience
        if stop:
            best = "none finite" if self.best is None else f"{self.best:.4f}"
            context.request_stop(
                f"early stopping at step {step}: {self.metric} did not improve by "
                f"{self.min_delta:g} or more in {self.patience} evaluations (best {best})"
            )
        if self.is_chief:
            record = {
                "metric": self.metric,
                "patience": self.patience,
                "min_delta": self.min_delta,
                "history": self.history,
            }
            if stop:
                record["stopped_at"] = step
            temporary = self.path + ".tmp"
            with open(temporary, "w") as f:
                json.dump(record, f, indent=2)
                f.write("\n")
            os.replace(temporary, self.path)
