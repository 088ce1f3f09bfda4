"""Every flag of run.py, declared from engine/config.py's Config fields, and the checks across flags.

Each flag's default, type, bounds, choices and help are written once, in its Config field
(`engine.config._option`); this module turns each field into an absl flag, adds the checks a
single bound cannot say, and builds the Config back from the parsed flags.
"""

from __future__ import annotations

import math
import re

from absl import flags as absl_flags

from engine import config as engine_config
from engine.config import EXPORT_FORMATS, METRIC_DIRECTIONS, Config
from engine.errors import UserError

# The headings of docs/flags.md (flags/reference.py): (heading, the first flag under it), in the
# order of Config's fields.
SECTIONS = (
    ("What this process does", "mode"),
    ("Distribution", "strategy"),
    ("Data", "dataset"),
    ("Model, task, optimizer", "model"),
    ("Schedule", "global_batch"),
    ("Output", "model_dir"),
    ("TensorBoard extras", "summaries"),
    ("Reproducibility and compilation", "seed"),
)


def _valid_best_metric(text: str) -> bool:
    if text in ("", *METRIC_DIRECTIONS):
        return True
    return bool(re.fullmatch(r"[+-][A-Za-z_][A-Za-z0-9_./]*", text))


def _finite_or_none(value) -> bool:
    return value is None or math.isfinite(value)


# What a flag's bounds cannot say: {flag: (check of the parsed value, the error's message)}.
CHECKS = {
    "eval_timeout": (lambda value: math.isfinite(value) and value > 0, "must be a finite number of seconds > 0"),
    "best_metric": (
        _valid_best_metric,
        "must be accuracy, loss, +NAME (higher is better) or -NAME (lower is better)",
    ),
    "validation_split": (
        lambda value: 0 <= value < 1,
        "must be a fraction with 0 < F < 1 (0: use DIR/train and DIR/test)",
    ),
    "learning_rate": (lambda rate: rate is None or (math.isfinite(rate) and rate > 0), "must be a finite number > 0"),
    "weight_decay": (_finite_or_none, "must be a finite number >= 0"),
    "clip_norm": (_finite_or_none, "must be a finite number >= 0"),
    "export_formats": (
        lambda text: engine_config.export_format_list(text) is not None,
        "use " + ", ".join(EXPORT_FORMATS) + " or a comma-separated list of them",
    ),
}

# absl's declaring function for each field type (looked up at each call).
_DEFINE = {str: "DEFINE_string", bool: "DEFINE_boolean", int: "DEFINE_integer", float: "DEFINE_float"}


def define_flags(flag_values: absl_flags.FlagValues = absl_flags.FLAGS) -> None:
    """Declares one flag per Config field on `flag_values` (absl's global FLAGS by default). Call once."""
    for name, kind, default, meta in engine_config.options():
        where = dict(flag_values=flag_values)
        if meta["choices"]:
            absl_flags.DEFINE_enum(name, default, meta["choices"], meta["help"], **where)
        elif kind in (int, float):
            bounds = dict(lower_bound=meta["lower"], upper_bound=meta["upper"])
            getattr(absl_flags, _DEFINE[kind])(name, default, meta["help"], **bounds, **where)
        else:
            getattr(absl_flags, _DEFINE[kind])(name, default, meta["help"], **where)
    for name, (check, message) in CHECKS.items():
        absl_flags.register_validator(name, check, message=f"--{name} {message}", flag_values=flag_values)


def config_from_flags(flag_values: absl_flags.FlagValues = absl_flags.FLAGS) -> Config:
    """The parsed flags as a frozen Config (after absl has validated each flag)."""
    v = flag_values
    if v.checkpoint and v.mode != "eval":
        raise UserError(
            f"--checkpoint={v.checkpoint} needs --mode=eval "
            "(training and continuous_eval use --model_dir's checkpoints)"
        )
    if v.evaluator and not (v.num_workers and v.strategy == "multi_worker_mirrored"):
        raise UserError(
            "--evaluator needs --strategy=multi_worker_mirrored --num_workers=N (the local launcher); on a "
            "cluster give TF_CONFIG an 'evaluator' task instead"
        )
    if v.max_restarts and not v.num_workers:
        raise UserError(
            f"--max_restarts={v.max_restarts} needs --num_workers=N (the local launcher restarts its "
            "workers); on a cluster the cluster manager restarts them: see deploy/ and docs/strategies.md"
        )
    return Config(**{name: getattr(v, name) for name, *_ in engine_config.options()})
