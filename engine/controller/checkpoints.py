"""Save and restore: tf.train.Checkpoint + CheckpointManager in model_dir/checkpoints.

Every worker saves (saving runs collectives under multi-worker strategies); the chief writes the
real checkpoint, the others write into a temporary directory that is deleted on close.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from engine.errors import UserError


class Checkpointer:
    def __init__(self, model_dir: str, is_chief: bool, max_to_keep: int, **trackables):
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.real_dir = os.path.join(model_dir, "checkpoints")
        self._temp_dir = None if is_chief else tempfile.mkdtemp(prefix="ctl_worker_ckpt_")
        directory = self.real_dir if is_chief else self._temp_dir
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)

    def restore_latest(self) -> str | None:
        """Restores the chief's latest checkpoint (every worker reads the real one); None if none."""
        latest = tf.train.latest_checkpoint(self.real_dir)
        if latest is None:
            return None
        status = None
        try:
            status = self.checkpoint.restore(latest)
            status.assert_existing_objects_matched()
        except (tf.errors.OpError, AssertionError, ValueError) as err:
            if status is not None:
                status.expect_partial()  # no "unrestored values" warning at exit: we stop anyway
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"cannot restore checkpoint {latest} (it does not match this model/optimizer, or is "
                f"corrupt: {first_line[:400]}); use a new --model_dir or the flags of that run"
            ) from None
        return latest

    def save(self, step: int) -> str:
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
