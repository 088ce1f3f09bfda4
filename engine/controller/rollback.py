"""--on_nonfinite=rollback: a bad step (a NaN/Inf loss or gradient on any replica, or a loss above
--loss_upper_bound) restores the last checkpoint (weights, every optimizer, the Task's state, the
EMA weights, the loss scale) and training goes on from there with the data moved past the bad
batch, so the same batches are not replayed; after --max_rollbacks rollbacks the next bad step
stops the run as --on_nonfinite=stop does (NON_FINITE).

The bad flag is computed from all-reduced values, so every worker rolls back at the same step to
the same checkpoint (every worker reads the chief's, as on resume). The data position is
checkpointed as `data_offset` (batches skipped so far: position = global_step + data_offset) with
the rollback count, and the restored step is saved again at once with both, so a run preempted
after a rollback resumes exactly.
"""

from __future__ import annotations

import tensorflow as tf


class Rollback:
    """The rollback budget and the restore itself; the trainer's `roll_back` (engine/controller/
    trainer.py) then saves the restored step and rebuilds the training data from the new position."""

    def __init__(self, max_rollbacks: int):
        self.max_rollbacks = max_rollbacks

    def allowed(self, state) -> bool:
        return int(state.rollbacks.numpy()) < self.max_rollbacks

    def restore(self, state, bad_step: int) -> tuple[int, int, str]:
        """Restores the latest checkpoint into `state` and moves its data position past `bad_step`
        (1-based global step number); returns (the restored step, the rollback count, the console line)."""
        bad_position = bad_step - 1 + int(state.data_offset.numpy())  # the bad batch's index in the stream
        count = int(state.rollbacks.numpy()) + 1
        latest = tf.train.latest_checkpoint(state.checkpointer.real_dir)
        state.checkpointer.restore(latest)
        restored = state.step
        state.data_offset.assign(bad_position + 1 - restored)
        state.rollbacks.assign(count)
        line = (
            f"rollback {count} of {self.max_rollbacks}: bad step {bad_step}; back to step {restored} "
            f"({latest}), the data moved past batch {bad_position}"
        )
        return restored, count, line
