"""A Task whose steps only run as plain Python (--run_eagerly): they read values with .numpy() and
print them, which a traced step cannot do. tests/test_run_eagerly.py loads it with
--task=tests/tasks_eager.py:PrintingTask and compares it with the default Task compiled."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from engine.task import Task

TRAIN_LINE = "eager train_step"  # the start of each line train_step prints
EVAL_LINE = "eager eval_step"


def _replica() -> int:
    return int(tf.distribute.get_replica_context().replica_id_in_sync_group)


class PrintingTask(Task):
    """The default classification Task, with a print of .numpy() values in train_step and eval_step."""

    def train_step(self, batch):
        images, labels = batch
        outputs = super().train_step(batch)
        total, count = outputs["loss"]
        # .numpy() of a tensor computed in this step: only an eager step has values to read.
        pixels = np.asarray(images.numpy())
        print(
            f"{TRAIN_LINE} replica {_replica()} step {int(self.global_step.numpy())} "
            f"examples {int(count.numpy())} labels {labels.numpy().tolist()} "
            f"pixel sum {pixels.sum():.3f} loss {float(total.numpy()) / float(count.numpy()):.6f}"
        )
        return outputs

    def eval_step(self, batch):
        outputs = super().eval_step(batch)
        print(f"{EVAL_LINE} replica {_replica()} examples {int(outputs['loss'][1].numpy())}")
        return outputs
