"""Save and restore: tf.train.Checkpoint + CheckpointManager in model_dir/checkpoints.

Every worker saves (saving runs collectives under multi-worker strategies); the chief writes the
real checkpoint, the others write into a temporary directory that is deleted on close. An
evaluator's Checkpointer (writable=False) has no manager: it only reads.

A resume (restore_latest) finds the checkpoints from the directory's files, not only from the
`checkpoint` state file (a hint, which may be garbage, empty, or list a checkpoint whose files are
gone), and starts from the newest one that reads back whole (invariant 14). Every worker makes the
same choice from the same files; only the chief then moves each newer, unreadable one into
checkpoints/damaged/ (never deleted) and rewrites the state file to list what really exists, so the
manager's rotation only ever deletes intact, older checkpoints. A checkpoint that reads back but
does not match the Task (another model, a Task attribute more or less) is not damaged: it stops the
run in one line and nothing is moved. When checkpoints exist but none reads back, the run stops in
one line and nothing is moved either: a rerun never starts again from step 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time

import tensorflow as tf

from engine import compat
from engine.controller.checkpoint_names import PREFIX, STATE_FILE, steps_with_files
from engine.errors import UserError

DAMAGED_DIR = "damaged"  # under checkpoints/: the unreadable checkpoints a resume set aside
_SHARD = re.compile(r"^\.data-\d+-of-(\d+)$")
_LISTED = re.compile(rf'"(?:[^"]*/)?({PREFIX}-\d+)"')


class CheckpointDamaged(UserError):
    """A checkpoint whose files cannot be read back (missing, truncated, corrupt). Where nothing
    catches it (a --checkpoint to evaluate, a rollback) it ends the run in one line, exit 2."""


def _damaged(path: str, why: str) -> CheckpointDamaged:
    err = CheckpointDamaged(f"checkpoint {path} cannot be read back ({why}); restore its files or use another one")
    err.path, err.why = path, why
    return err


def checkpoint_files(prefix: str) -> list:
    """The files of the checkpoint at `prefix` that exist (its .index and data shards)."""
    directory, name = os.path.split(prefix)
    try:
        names = tf.io.gfile.listdir(directory or ".")
    except tf.errors.NotFoundError:
        return []
    return sorted(os.path.join(directory, n) for n in names if n == name + ".index" or n.startswith(name + ".data-"))


def unreadable(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` cannot be read back whole (None: it can). Reads its index
    and every tensor, so a missing shard, a truncated file or a checksum error is found here,
    before anything is restored."""
    files = checkpoint_files(prefix)
    if not files:
        return "none of its files exist"
    if prefix + ".index" not in files:
        return "its .index file is missing"
    data = [f for f in files if f != prefix + ".index"]
    if not data:
        return "its data file is missing"
    counts = {int(m.group(1)) for f in data if (m := _SHARD.match(f[len(prefix) :]))}
    if len(counts) == 1 and len(data) < (count := counts.pop()):
        return f"{count - len(data)} of its {count} data shards are missing"
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as err:  # noqa: BLE001 (any failure to read is damage: OpError, IndexError, ...)
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        return f"reading it failed: {first[:200]}"
    return None


def found_checkpoints(directory: str) -> list:
    """[(step, prefix)] of every checkpoint in `directory`, newest first: each ckpt-<step> that has
    a file there, and each the `checkpoint` state file lists (files or not)."""
    try:
        names = tf.io.gfile.listdir(directory)
    except tf.errors.NotFoundError:
        return []
    steps = steps_with_files(names)
    steps |= {int(name.rpartition("-")[2]) for name in listed_names(directory)}
    return [(step, os.path.join(directory, f"{PREFIX}-{step}")) for step in sorted(steps, reverse=True)]


def listed_names(directory: str) -> list:
    """The checkpoint names (ckpt-<step>) the state file mentions; [] when it is absent or garbage.
    Read as text, not parsed: it is only a hint (tf.train.get_checkpoint_state raises on an
    empty one and logs a parse error for garbage)."""
    try:
        with tf.io.gfile.GFile(os.path.join(directory, STATE_FILE)) as f:
            text = f.read()
    except (tf.errors.OpError, UnicodeDecodeError):
        return []
    return sorted(set(_LISTED.findall(text)))


@dataclasses.dataclass
class Resumed:
    """What restore_latest found: the checkpoint restored and the newer ones that did not read back."""

    path: str
    damaged: list  # [(prefix, why, whether it has files)], newest first
    moved: bool  # whether this process moved them (the chief) into damaged/
    damaged_dir: str
    listed: list | None = None  # what the rewritten `checkpoint` state file lists (None: not rewritten)

    def lines(self) -> list:
        """One console line per damaged checkpoint: which, why, where it went, what resumes."""
        moved = (
            f"moved to {self.damaged_dir}/" if self.moved else f"skipped (the chief moves it to {self.damaged_dir}/)"
        )
        return [
            f"damaged      {os.path.basename(prefix)} cannot be read back ({why}): "
            f"{moved if files else 'skipped'}; resuming from {os.path.basename(self.path)}"
            for prefix, why, files in self.damaged
        ] + (
            [
                f"checkpoints  rewrote {os.path.join(os.path.dirname(self.path), STATE_FILE)} to list the "
                f"checkpoints that exist ({', '.join(self.listed)})"
            ]
            if self.listed
            else []
        )


def held_names(prefix: str) -> set:
    """The names of the objects at the root of the checkpoint at `prefix` (model, optimizer, ema, ...)."""
    return {child.local_name for child in compat.checkpoint_object_graph(prefix).nodes[0].children}


class Checkpointer:
    def __init__(
        self,
        model_dir: str,
        is_chief: bool,
        max_to_keep: int,
        writable: bool = True,
        verify=None,
        optional=None,
        **trackables,
    ):
        """verify(path): raises UserError when the checkpoint at `path` must not be restored (it is
        called before anything is restored). optional: {name: initialise} for the trackables a
        checkpoint may lack (state a flag added on resume: --ema_decay's averages, rollback's
        counters); a restore leaves those out and calls initialise() after restoring the rest, once
        per distinct function, and `initialised` names them."""
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.trackables = trackables
        self.optional = optional or {}
        self.initialised: list = []  # the optional trackables the last restore initialised
        self.verify = verify
        self.is_chief = is_chief
        self.max_to_keep = max_to_keep
        self.real_dir = os.path.join(model_dir, "checkpoints")
        self.damaged_dir = os.path.join(self.real_dir, DAMAGED_DIR)
        self._temp_dir = None if is_chief or not writable else tempfile.mkdtemp(prefix="ctl_worker_ckpt_")
        self.writable = writable
        self._manager = None
        self.resumed: Resumed | None = None

    @property
    def manager(self):
        """The CheckpointManager, made on first use: after restore_latest has rewritten the state
        file, so its rotation starts from the checkpoints that really exist."""
        if self._manager is None and self.writable:
            directory = self.real_dir if self.is_chief else self._temp_dir
            self._manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=self.max_to_keep)
        return self._manager

    def restore_latest(self) -> str | None:
        """Restores the newest checkpoint of the chief's directory that reads back whole (every
        worker reads the real one); None if there is none. See the module's docstring."""
        found = found_checkpoints(self.real_dir)
        if not found:
            self._refuse_if_only_damaged()
            return None
        damaged = []
        for _, prefix in found:
            try:
                self.restore(prefix)
            except CheckpointDamaged as err:
                damaged.append((prefix, err.why, bool(checkpoint_files(prefix))))
                continue
            self.resumed = Resumed(prefix, damaged, self.is_chief and self.writable, self.damaged_dir)
            if self.resumed.moved:
                self._set_aside(damaged)
                self.resumed.listed = self._rewrite_state(prefix)
            return prefix
        shown = "; ".join(f"{os.path.basename(p)}: {why}" for p, why, _ in damaged)
        raise UserError(
            f"no checkpoint in {self.real_dir} reads back whole ({shown}); nothing was moved (a resume "
            f"moves damaged ones to {self.damaged_dir}/ only when an intact one is left); restore the "
            "files or use a new --model_dir"
        )

    def restore(self, path: str) -> None:
        """Restores the checkpoint at `path` (a prefix). One whose files cannot be read back raises
        CheckpointDamaged (its files are all gone: `why` says so); one that reads back but does not
        match this Task is a UserError."""
        why = unreadable(path)
        if why is not None:
            raise _damaged(path, why)
        status = None
        try:
            if self.verify is not None:
                self.verify(path)
            held = held_names(path)
            missing = [name for name in self.optional if name not in held]
            checkpoint = self.checkpoint
            if missing:  # restored without them, then initialised
                checkpoint = tf.train.Checkpoint(**{k: v for k, v in self.trackables.items() if k not in missing})
            status = checkpoint.restore(path)
            status.assert_existing_objects_matched()
            if held - set(self.trackables):  # state a flag dropped on resume (the EMA): left unread, no warning
                status.expect_partial()
            for initialise in {id(self.optional[name]): self.optional[name] for name in missing}.values():
                initialise()
            self.initialised = missing
        except (tf.errors.NotFoundError, tf.errors.DataLossError) as err:
            if status is not None:
                status.expect_partial()
            why = unreadable(path)  # deleted or damaged while it was read
            raise _damaged(path, why or str(err).strip().splitlines()[0][:200]) from None
        except (tf.errors.OpError, AssertionError, ValueError) as err:
            if status is not None:
                status.expect_partial()  # no "unrestored values" warning at exit: we stop anyway
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"cannot restore checkpoint {path} (it does not match this model/optimizer: "
                f"{first_line[:400]}); use a new --model_dir or the flags of that run"
            ) from None

    def _set_aside(self, damaged: list) -> None:
        """Moves each damaged checkpoint's files into damaged/ (a name taken there gets a suffix)."""
        for prefix, _, _ in damaged:
            files = checkpoint_files(prefix)
            if not files:
                continue
            tf.io.gfile.makedirs(self.damaged_dir)
            name = os.path.basename(prefix)
            target, n = name, 0
            while any(tf.io.gfile.exists(os.path.join(self.damaged_dir, target + f[len(prefix) :])) for f in files):
                n += 1
                target = f"{name}.{n}"
            for f in files:
                tf.io.gfile.rename(f, os.path.join(self.damaged_dir, target + f[len(prefix) :]))

    def _rewrite_state(self, restored: str) -> list | None:
        """The state file lists the checkpoints that exist up to the restored one, and names it the
        latest (rewritten only when it says anything else)."""
        step = int(restored.rpartition("-")[2])
        kept = [
            p for s, p in reversed(found_checkpoints(self.real_dir)) if s < step and tf.io.gfile.exists(p + ".index")
        ]
        kept.append(restored)
        names = [os.path.basename(p) for p in kept]  # by step
        if listed_names(self.real_dir) == sorted(names) and _latest_named(self.real_dir) == os.path.basename(restored):
            return None
        # The manager's own text format; every checkpoint gets a timestamp after the last preserved
        # one, or the manager would not count it for rotation.
        now = time.time()
        text = f'model_checkpoint_path: "{os.path.basename(restored)}"\n'
        text += "".join(f'all_model_checkpoint_paths: "{os.path.basename(p)}"\n' for p in kept)
        text += "".join(f"all_model_checkpoint_timestamps: {now}\n" for _ in kept)
        text += f"last_preserved_timestamp: {now - 1}\n"
        target = os.path.join(self.real_dir, STATE_FILE)
        with tf.io.gfile.GFile(target + ".tmp", "w") as f:
            f.write(text)
        tf.io.gfile.rename(target + ".tmp", target, overwrite=True)
        return names

    def _refuse_if_only_damaged(self) -> None:
        """No checkpoint left but damaged/ holds some: starting again from step 0 would lose the run."""
        try:
            names = tf.io.gfile.listdir(self.damaged_dir)
        except tf.errors.NotFoundError:
            return
        held = sorted({name.partition(".")[0] for name in names if name.endswith(".index") or ".data-" in name})
        if held:
            raise UserError(
                f"{self.real_dir} holds no checkpoint, only damaged ones set aside in {self.damaged_dir}/ "
                f"({', '.join(held)}); training would start again from step 0: restore an intact "
                f"checkpoint, use a new --model_dir, or delete {self.real_dir} to start again"
            )

    def save(self, step: int) -> str:
        """Saves (every worker); returns the chief's checkpoint of this step, the one a resume reads."""
        path = self.manager.save(checkpoint_number=step)
        return path if self.is_chief else os.path.join(self.real_dir, os.path.basename(path))

    def close(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


def _latest_named(directory: str) -> str | None:
    """The checkpoint name the state file gives as the latest (its first line), if any."""
    try:
        with tf.io.gfile.GFile(os.path.join(directory, STATE_FILE)) as f:
            first = f.readline()
    except (tf.errors.OpError, UnicodeDecodeError):
        return None
    match = _LISTED.search(first)
    return match.group(1) if first.startswith("model_checkpoint_path") and match else None
