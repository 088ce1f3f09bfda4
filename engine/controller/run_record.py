"""The run's configuration is part of the run: `model_dir/config.json`.

A fresh run (no checkpoint yet) records its flags there (chief only). A resumed run compares the
flags that decide what the checkpoint and the data mean (RECORDED_IDENTITY) and facts of the data
(DATA_FACTS: its class names when the source has them, e.g. the folders of --dataset=images:DIR;
whether its order is a stream's or in-memory arrays', which --input_mode=resident changes for a
streamed source) with the record, and stops with a UserError naming each difference, unless
--allow_config_change. Every other flag (learning rate, weight decay, clipping, accumulation, EMA,
rollback, train_steps, ...) may change between a run and its resumption, and each change is named
(invariant 14): one banner line per flag (`changed      --learning_rate 0.001 -> 0.5 at step 4`),
and the record, rewritten with the new flags, keeps a history of every change and its step
(`changes`). A resume on another layout (workers x replicas, e.g. an srun or a TF_CONFIG of
another size with the same flags) is named and kept the same way (`layout`). Only the flags in
NOT_COMPARED, which say nothing about the training, are not compared. Checkpoints without a
record are refused (their flags cannot be compared) unless --allow_config_change. Keys the record
has and this engine does not know are ignored, so older or newer records still load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from engine.controller import storage
from engine.controller.checkpoints import found_checkpoints
from engine.errors import UserError

FILE_NAME = "config.json"
LAYOUT = "layout"  # the record's fact (and history entry) of the run's workers x replicas
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


# Never compared: the directory itself, the override, and what only an evaluation reads.
NOT_COMPARED = ("model_dir", "allow_config_change", "mode", "checkpoint", "eval_timeout", "evaluator")


@dataclasses.dataclass(frozen=True)
class Change:
    """One flag whose value differs from the run's record on resume (allowed)."""

    name: str
    old: object
    new: object

    def line(self, step: int) -> str:
        """The banner's line for it."""
        if self.name == FILE_NAME:
            return f"changed      no {FILE_NAME}: this run's flags are recorded as the run's at step {step}"
        if self.name == LAYOUT:
            return (
                f"changed      layout {self.old} -> {self.new} at step {step} (the same global batch, "
                "so training continues as if it had this layout from that step)"
            )
        note = _note(self)
        return f"changed      --{self.name} {_value(self.old)} -> {_value(self.new)} at step {step}" + (
            f" ({note})" if note else ""
        )

    def entry(self, step: int) -> dict:
        """The record's history entry for it."""
        key = "fact" if self.name == LAYOUT else "flag"
        return {"step": step, key: self.name, "from": self.old, "to": self.new}


def _value(value) -> str:
    return "unset" if value is None else "''" if value == "" else str(value)


def _note(change: Change) -> str:
    """What a change means beyond its new value, where that is not obvious."""
    if change.name == "seed":
        return "the resumed run keeps the seed its checkpoint holds"
    if change.name == "ema_decay" and not change.new:
        return "the checkpoint's weight averages are dropped"
    if change.name == "on_nonfinite" and change.old == "rollback":
        return "rollback's counters are no longer checkpointed"
    if change.name in RECORDED_IDENTITY:
        return "allowed by --allow_config_change"
    return ""


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
    changed = {c.name: c for c in changes(recorded, config)}
    return [(name, changed[name].old, changed[name].new) for name in RECORDED_IDENTITY if name in changed]


def changes(recorded: dict, config) -> list[Change]:
    """Every flag of this run whose value differs from the record's (NOT_COMPARED left out; a
    flag the record lacks, from an older engine, is not compared)."""
    current = json.loads(json.dumps(config.as_dict()))  # as the record holds it (lists, not tuples)
    return [
        Change(name, recorded[name], value)
        for name, value in current.items()
        if name not in NOT_COMPARED and name in recorded and recorded[name] != value
    ]


def check_resume(config) -> list[Change]:
    """Stops a resumed run whose identity flags differ from the record (unless allowed), or whose
    checkpoints have no record. Returns every allowed change (empty for a fresh run or an
    unchanged one); the caller names them (Change.line) and records them (write)."""
    _check_is_dir(config.model_dir)
    if not _has_checkpoint(config.model_dir):
        return []  # nothing to resume: a fresh run, whatever an earlier failed start recorded
    recorded = read(config.model_dir)
    if recorded is None:
        if not config.allow_config_change:
            raise UserError(
                f"--model_dir={config.model_dir} holds checkpoints but no {FILE_NAME} (the run's record), so "
                "this run's flags cannot be compared with the ones it was trained with; restore "
                f"{path(config.model_dir)}, use a new --model_dir, or pass --allow_config_change to resume "
                "with these flags (then recorded)"
            )
        return [Change(FILE_NAME, None, "these flags")]
    changed = changes(recorded, config)
    identity = sorted(
        (c for c in changed if c.name in RECORDED_IDENTITY), key=lambda c: RECORDED_IDENTITY.index(c.name)
    )
    if identity and not config.allow_config_change:
        shown = ", ".join(f"--{c.name}={c.old!r} -> {c.new!r}" for c in identity)
        raise UserError(
            f"--model_dir={config.model_dir} holds a run with different flags ({shown}, recorded in "
            f"{path(config.model_dir)}); resume with that run's flags, use a new --model_dir, or pass "
            "--allow_config_change to change them on purpose"
        )
    return changed


def layout(num_workers: int, num_replicas: int) -> str:
    """The record's `layout` fact, e.g. `2 workers x 1 replica`."""
    per_worker = num_replicas // max(num_workers, 1)
    return f"{num_workers} worker{'s' * (num_workers != 1)} x {per_worker} replica{'s' * (per_worker != 1)}"


def layout_change(config, current: str) -> list[Change]:
    """[the Change] where a resumed run's layout differs from the one its record holds (records
    from before the layout was recorded are not compared), else []."""
    if not _has_checkpoint(config.model_dir):
        return []
    recorded = (_read_record(config.model_dir) or {}).get(LAYOUT)
    return [Change(LAYOUT, recorded, current)] if recorded and recorded != current else []


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


def write(config, extra: dict, changed=(), step: int = 0) -> str:
    """Writes model_dir/config.json (atomically): this run's flags plus `extra` facts, and the
    record's history of changes (`changes`) with this resume's `changed` at `step` added. A fresh
    run (step 0, nothing changed) starts a new history."""
    target = path(config.model_dir)
    history = []
    if step or changed:
        try:
            history = list((_read_record(config.model_dir) or {}).get("changes") or [])
        except UserError:
            history = []  # an unreadable record is refused before this; a vanished one has no history
    history += [c.entry(step) for c in changed if c.name != FILE_NAME]
    record = {"flags": config.as_dict(), **extra, **({"changes": history} if history else {})}
    temporary = target + ".tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(temporary, target)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if not storage.cause(err):
            raise
        raise storage.failed(f"writing the run record {target}", storage.cause(err), config.model_dir) from None
    return target
