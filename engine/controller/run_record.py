"""The run's configuration is part of the run: `model_dir/config.json`.

A fresh run (no checkpoint yet) records its flags there (chief only). A resumed run compares the
flags that decide what the checkpoint and the data mean (RECORDED_IDENTITY) and facts of the data
(DATA_FACTS: its class names when the source has them, e.g. the folders of --dataset=images:DIR;
whether its order is a stream's or in-memory arrays', which --input_mode=resident changes for a
streamed source) with the record, and stops with a UserError naming each difference, unless
--allow_config_change. Other flags
(train_steps, steps_per_loop, ...) may change between a run and its resumption. Keys the record
has and this engine does not know are ignored, so older or newer records still load.
"""

from __future__ import annotations

import json
import os

from engine.controller.checkpoints import found_checkpoints
from engine.errors import UserError

FILE_NAME = "config.json"
# Resuming with a different value of one of these is an error (--allow_config_change overrides).
# model, optimizer, lr_schedule and precision also decide which variables the checkpoint holds.
RECORDED_IDENTITY = (
    "model",
    "dataset",
    "global_batch",
    "task",
    "optimizer",
    "lr_schedule",
    "precision",
    "image_size",
    "validation_split",
    "synthetic_shape",
    "num_classes",
    "seq_len",
)


def path(model_dir: str) -> str:
    return os.path.join(model_dir, FILE_NAME)


def _check_is_dir(model_dir: str) -> None:
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise UserError(f"--model_dir={model_dir} exists and is not a directory; choose another --model_dir")


def create_model_dir(model_dir: str) -> None:
    """Creates --model_dir (chief only); one that cannot be created is a UserError."""
    _check_is_dir(model_dir)
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --model_dir={model_dir} ({err.strerror}); choose a writable path") from None


def read(model_dir: str) -> dict | None:
    """The recorded flags, or None when the run has no record (a fresh run, or an older engine's)."""
    record = _read_record(model_dir)
    return None if record is None else record["flags"]


def _read_record(model_dir: str) -> dict | None:
    try:
        with open(path(model_dir)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path(model_dir)} ({err}); fix or delete it to resume") from None
    if not isinstance(record, dict) or not isinstance(record.get("flags"), dict):
        raise UserError(f"{path(model_dir)} holds no 'flags' object; fix or delete it to resume")
    return record


def differences(recorded: dict, config) -> list[tuple[str, object, object]]:
    """[(flag, recorded value, this run's value)] for the RECORDED_IDENTITY flags that differ."""
    current = config.as_dict()
    return [
        (name, recorded[name], current[name])
        for name in RECORDED_IDENTITY
        if name in recorded and recorded[name] != current[name]
    ]


def check_resume(config) -> list:
    """Stops a resumed run whose identity flags differ from the record (unless allowed).

    Returns the allowed differences (empty for a fresh run or an unchanged one).
    """
    _check_is_dir(config.model_dir)
    if not _has_checkpoint(config.model_dir):
        return []  # nothing to resume: a fresh run, whatever an earlier failed start recorded
    recorded = read(config.model_dir)
    changed = differences(recorded, config) if recorded is not None else []
    if changed and not config.allow_config_change:
        shown = ", ".join(f"--{name}={old!r} -> {new!r}" for name, old, new in changed)
        raise UserError(
            f"--model_dir={config.model_dir} holds a run with different flags ({shown}, recorded in "
            f"{path(config.model_dir)}); resume with that run's flags, use a new --model_dir, or pass "
            "--allow_config_change to change them on purpose"
        )
    return changed


def _has_checkpoint(model_dir: str) -> bool:
    # From the files, not only the state file (which may be garbage or empty): see checkpoints.py.
    return bool(found_checkpoints(os.path.join(model_dir, "checkpoints")))


def _shown(names, most: int = 12) -> str:
    if not isinstance(names, (list, tuple)):
        return str(names)
    names = list(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


# Facts of the data a run records beside its flags, and what changing one under a checkpoint means.
DATA_FACTS = {
    "class_names": (
        "was trained on classes [{recorded}] but --dataset={dataset} has [{current}]",
        "restore the class folders",
    ),
    "data_order": (
        "was trained on data drawn {recorded} but this run draws it {current} (another order "
        "of examples: the resume would not be exact)",
        "resume with that run's --input_mode",
    ),
}


def data_order(source) -> str:
    """How a source's examples are ordered: a stream's shuffle buffer, or a permutation of arrays
    (every --input_mode of an in-memory source draws the same batches)."""
    return "streamed (shuffle buffer)" if source.streamed else "from memory (a permutation an epoch)"


def check_data_facts(config, facts: dict) -> bool:
    """Stops a resumed run whose data differs from the record in a DATA_FACTS fact (e.g. a class
    folder added, removed or renamed: the same label would mean another class), unless allowed.

    `facts`: {name: value} of the facts this run's data has (none empty).
    Returns whether one changed (allowed): the record is then rewritten."""
    if not _has_checkpoint(config.model_dir):
        return False
    record = _read_record(config.model_dir) or {}
    changed = [name for name, value in facts.items() if record.get(name) is not None and record[name] != value]
    if changed and not config.allow_config_change:
        name = changed[0]
        what, remedy = DATA_FACTS[name]
        raise UserError(
            f"--model_dir={config.model_dir} "
            + what.format(recorded=_shown(record[name]), current=_shown(facts[name]), dataset=config.dataset)
            + f" (recorded in {path(config.model_dir)}); {remedy}, use a new --model_dir, or pass --allow_config_change"
        )
    return bool(changed)


def write(config, extra: dict) -> str:
    """Writes model_dir/config.json (atomically): this run's flags plus `extra` facts."""
    target = path(config.model_dir)
    record = {"flags": config.as_dict(), **extra}
    temporary = target + ".tmp"
    with open(temporary, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(temporary, target)
    return target
