"""Tasks for tests/test_gather.py (loaded with --task=tests/tasks_gather.py:Name): steps that call a
raw replica-context collective, which the engine refuses in one line where TensorFlow cannot run it,
and a SimCLR Task that records the collective ops of its traced step."""

from __future__ import annotations

import os

import tensorflow as tf

from engine.task import Task
from examples.simclr import SimclrTask


class RawAllGatherTask(Task):
    """Gathers the batch's logits with get_replica_context().all_gather instead of self.all_gather."""

    def train_step(self, batch):
        images, _ = batch
        gathered = tf.distribute.get_replica_context().all_gather(tf.reshape(images, [-1]), axis=0)
        outputs = super().train_step(batch)
        return dict(outputs, loss=(outputs["loss"][0] + 0.0 * tf.reduce_sum(gathered), outputs["loss"][1]))


class RawMergeCallTask(Task):
    """Calls merge_call in the step (a raw cross-replica function)."""

    def train_step(self, batch):
        tf.distribute.get_replica_context().merge_call(lambda strategy: None)
        return super().train_step(batch)


class GatherOpsSimclrTask(SimclrTask):
    """examples/simclr.py's Task that writes, while its train_step is traced, the collective ops of
    the step's graph just after the forward pass's gathers (to <model_dir>/ops-<pid>.txt)."""

    def contrastive(self, z1, z2, offset):
        result = super().contrastive(z1, z2, offset)
        graph = tf.compat.v1.get_default_graph()
        lines = [
            f"{op.type} {[tuple(output.shape) for output in op.outputs]}"
            for op in graph.get_operations()
            if op.type.startswith("Collective")
        ]
        os.makedirs(self.config.model_dir, exist_ok=True)
        with open(os.path.join(self.config.model_dir, f"ops-{os.getpid()}.txt"), "a") as file:
            file.write("\n".join(lines) + "\n")
        return result
