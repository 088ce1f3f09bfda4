"""Save and restore: tf.train.Checkpoint + CheckpointManager in model_dir/checkpoints.

Every worker saves (saving runs collectives under multi-worker strategies); the chief writes the
real checkpoint, the others write into a temporary directory that is deleted on close. An
evaluator's Checkpointer (writable=False) has no manager: it only reads.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from engine.errors import UserError


class Checkpointer:
    def __init__(
        self, model_dir: str, is_chief: bool, max_to_keep: int, writable: bool = True, verify=None, **trackables
    ):
        """verify(path): raises UserError when the checkpoint at `path` must not be restored (it is
        called before anything is restored)."""
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.verify = verify
        self.real_dir = os.path.join(model_dir, "checkpoints")
        self._temp_dir = None if is_chief or not writable else tempfile.mkdtemp(prefix="ctl_worker_ckpt_")
        directory = self.real_dir if is_chief else self._temp_dir
        self.manager = (
            tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep) if writable else None
        )

    def restore_latest(self) -> str | None:
        """Restores the chief's latest checkpoint (every worker reads the real one); None if none."""
        latest = tf.train.latest_checkpoint(self.real_dir)
        if latest is None:
            return None
        try:
            self.restore(latest)
        except tf.errors.NotFoundError:
            raise UserError(
                f"cannot restore checkpoint {latest}: its files are missing (the 'checkpoint' "
                "file lists it); use a new --model_dir or restore the files"
            ) from None
        return latest

    def restore(self, path: str) -> None:
        """Restores the checkpoint at `path` (a prefix); one that does not match or is corrupt is a
        UserError, one whose files are gone raises tf.errors.NotFoundError."""
        status = None
        try:
            if self.verify is not None:
                self.verify(path)
            status = self.checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except tf.errors.NotFoundError:
            if status is not None:
                status.expect_partial()
            if not tf.io.gfile.exists(path + ".index") or not tf.io.gfile.glob(path + ".data-*"):
                raise  # deleted (e.g. by the checkpoint manager): the caller decides
            raise UserError(f"cannot restore checkpoint {path} (unreadable)") from None
        except (tf.errors.OpError, AssertionError, ValueError) as err:
            if status is not None:
                status.expect_partial()  # no "unrestored values" warning at exit: we stop anyway
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"cannot restore checkpoint {path} (it does not match this model/optimizer, or is "
                f"corrupt: {first_line[:400]}); use a new --model_dir or the flags of that run"
            ) from None

    def save(self, step: int) -> str:
        return self.manager.save(checkpoint_number=step)

    def close(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
