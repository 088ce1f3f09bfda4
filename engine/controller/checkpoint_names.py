"""How checkpoints are named on disk (CheckpointManager's layout), without TensorFlow: the
launcher, which must not import TensorFlow, reads the same names as a resume does."""

from __future__ import annotations

import re

PREFIX = "ckpt"  # CheckpointManager's file names: ckpt-<step>.index, ckpt-<step>.data-<i>-of-<n>
STATE_FILE = "checkpoint"  # CheckpointManager's state file
FILE = re.compile(rf"^{PREFIX}-(\d+)\.(index|data-\d+-of-\d+)$")


def steps_with_files(names) -> set:
    """The steps of every ckpt-<step> that has a file among `names` (a directory's listing)."""
    return {int(m.group(1)) for name in names if (m := FILE.match(name))}
