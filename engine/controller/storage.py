"""Storage faults end in one line (issue 46 item 4): a write into --model_dir that the filesystem
refuses (disk full, read-only, no permission, a quota or file-size limit) during a checkpoint save,
the event files, the run record or the run's lock stops the run with StorageFailed (exit 3,
engine/exit_codes.py): one line naming what failed where, the partial temporary checkpoint
(ckpt-N_temp*) removed, and the newest checkpoint that still reads back named as intact.
"""

from __future__ import annotations

import errno
import os
import shutil

import tensorflow as tf

from engine.controller import checkpoints
from engine.errors import StorageFailed

# The causes a write into the run directory can meet, by errno and as TensorFlow's messages say them.
ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG, errno.ENOTDIR)
_PHRASES = tuple(os.strerror(code) for code in ERRNOS)


def cause(err: BaseException) -> str | None:
    """The storage fault behind `err` in a few words ("No space left on device"), or None when it is
    not one (an OSError with another errno, any other TensorFlow error)."""
    if isinstance(err, OSError) and not isinstance(err, tf.errors.OpError):
        return os.strerror(err.errno) if err.errno in ERRNOS else None
    if isinstance(err, tf.errors.OpError):
        text = str(err)
        return next((phrase for phrase in _PHRASES if phrase in text), None)
    return None


def remove_partial(directory: str, step: int | None) -> list:
    """Removes what a failed save of ckpt-<step> left in `directory`: its temporary files and folders
    (ckpt-<step>_temp*) and its own files when they do not read back whole. Returns their names."""
    if step is None:
        return []
    name = f"{checkpoints.PREFIX}-{step}"
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        if entry.startswith(name + "_temp"):
            target = os.path.join(directory, entry)
            try:
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
            except OSError:
                continue
            removed.append(entry)
    prefix = os.path.join(directory, name)
    if checkpoints.checkpoint_files(prefix) and checkpoints.unreadable(prefix) is not None:
        for path in checkpoints.checkpoint_files(prefix):
            try:
                os.remove(path)
            except OSError:
                continue
            removed.append(os.path.basename(path))
    return removed


def intact(directory: str) -> str:
    """Which checkpoint of `directory` is intact (the newest that reads back whole), in words."""
    for _, prefix in checkpoints.found_checkpoints(directory):
        if checkpoints.unreadable(prefix) is None:
            return f"the previous checkpoint {prefix} is intact"
    return "no checkpoint was written before"


def failed(what: str, cause_text: str, model_dir: str, step: int | None = None, saved_in=None) -> StorageFailed:
    """StorageFailed for `what` failing (e.g. "saving checkpoint ckpt-6 into D/checkpoints") for
    `cause_text`; the partial checkpoint of `step` removed first from `saved_in` (the directory
    the save wrote into: the run's checkpoints/, or a non-chief worker's temporary one)."""
    directory = os.path.join(model_dir, "checkpoints")
    removed = remove_partial(saved_in or directory, step)
    return StorageFailed(
        f"{what} failed ({cause_text})"
        + (f"; removed the partial {', '.join(removed)}" if removed else "")
        + f"; {intact(directory)}; free space under --model_dir={model_dir} or make it writable, then rerun "
        "the same command to resume"
    )
