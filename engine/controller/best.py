"""The best checkpoint by one eval metric: `model_dir/best/` holds a checkpoint of the whole
training state (restorable like any in checkpoints/), the exported model (model.keras) and
best.json ({"metric", "higher_is_better", "step", "value", "checkpoint"}).

Whichever process evaluates keeps it: the chief during training, or the evaluator job (a sidecar
or --mode=eval); never both, since training with a sidecar does not evaluate. The direction of
--best_metric: `accuracy` higher is better, `loss` lower (engine/config.py METRIC_DIRECTIONS);
any other eval metric needs a sign: +NAME higher is better, -NAME lower.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

from engine.config import METRIC_DIRECTIONS
from engine.errors import UserError

DIR_NAME = "best"
FILE_NAME = "best.json"


def parse_best_metric(text: str) -> tuple[str, bool]:
    """(metric name, higher is better) of a --best_metric value."""
    if text[:1] in "+-" and len(text) > 1:
        return text[1:], text[0] == "+"
    if text in METRIC_DIRECTIONS:
        return text, METRIC_DIRECTIONS[text] == "+"
    raise UserError(
        f"--best_metric={text!r}: use {', '.join(METRIC_DIRECTIONS)}, +NAME (higher is better) "
        "or -NAME (lower is better)"
    )


def read(model_dir: str) -> dict | None:
    try:
        with open(os.path.join(model_dir, DIR_NAME, FILE_NAME)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(
            f"cannot read {os.path.join(model_dir, DIR_NAME, FILE_NAME)} ({err}); fix or delete it"
        ) from None


class BestKeeper:
    """update(step, metrics, checkpoint, model) after each evaluation. Every worker of a
    multi-worker run calls it (writing a checkpoint may run collectives); only the chief's copy
    lands in model_dir/best, the others write into a temporary directory."""

    def __init__(self, model_dir: str, spec: str, *, metric_names, is_chief: bool = True):
        self.name, self.higher_is_better = parse_best_metric(spec)
        if self.name not in metric_names:
            raise UserError(
                f"--best_metric={spec}: the task's eval metrics are {', '.join(metric_names)}; "
                f"there is no {self.name!r} (eval_summary's count once listed in eval_summary_metrics)"
            )
        self.model_dir, self.is_chief = model_dir, is_chief
        self.directory = os.path.join(model_dir, DIR_NAME)
        self.record = read(model_dir)  # every worker: the same decision (model_dir is shared, as for resume)
        if self.record and self.record.get("metric") != self.name:
            self.record = None  # another metric was kept before: start over with this one
        self._temp_dir = None

    def better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.record is None:
            return True
        best = self.record["value"]
        return value > best if self.higher_is_better else value < best

    def update(self, step: int, metrics: dict, checkpoint, model, save_model=None) -> str | None:
        """Keeps this state when its metric beats the best so far; returns a console line if so.
        save_model(path): writes the model file (default model.save; e.g. with the EMA weights)."""
        value = float(metrics[self.name])
        if not self.better(value):
            return None
        if not self.is_chief:  # the decision is the same everywhere (metrics are all-reduced)
            self._temp_dir = self._temp_dir or tempfile.mkdtemp(prefix="ctl_worker_best_")
            checkpoint.write(os.path.join(self._temp_dir, "ckpt"))
            self.record = {"value": value}
            return None
        staging = tempfile.mkdtemp(prefix=".best-", dir=self.model_dir)
        checkpoint.write(os.path.join(staging, "ckpt"))
        (save_model or model.save)(os.path.join(staging, "model.keras"))
        self.record = {
            "metric": self.name,
            "higher_is_better": self.higher_is_better,
            "step": step,
            "value": value,
            "checkpoint": os.path.join(self.directory, "ckpt"),
        }
        with open(os.path.join(staging, FILE_NAME), "w") as f:
            json.dump(self.record, f, indent=2, sort_keys=True)
            f.write("\n")
        old = None
        if os.path.exists(self.directory):
            old = self.directory + f".old-{os.getpid()}"
            os.replace(self.directory, old)
        os.replace(staging, self.directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return f"best   step {step}: {self.name} {value:.4f} kept in {self.directory}"

    def close(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
