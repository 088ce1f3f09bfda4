"""Tasks that make one process of a run fail, hang, die or slow down, as a bad environment, a hung
filesystem or an OOM killer would: tests/test_multi_worker.py, tests/test_stall.py,
tests/test_restarts.py and tests/test_eval_mode.py load them with --task=tests/tasks_faults.py:Name."""

from __future__ import annotations

import json
import os
import signal
import time

import tensorflow as tf

from engine.errors import UserError
from engine.task import Task


def _worker_index() -> int:
    """This process's TF_CONFIG task index (0 without TF_CONFIG)."""
    return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))


class FailOnWorkerOneTask(Task):
    """Fails on worker 1 only (as a bug in one worker's environment would)."""

    def __init__(self, config, **kwargs):
        if _worker_index() == 1:
            raise UserError("FailOnWorkerOneTask: worker 1 fails on purpose")
        super().__init__(config, **kwargs)


def _sleep_a_quarter_second():
    time.sleep(0.25)
    return 0


class SlowTrainingTask(Task):
    """The default step, 0.25 s slower: training stays running while a sidecar evaluator works (or
    while a test stops one worker)."""

    def train_step(self, batch):
        with tf.control_dependencies([tf.py_function(_sleep_a_quarter_second, [], tf.int32)]):
            return super().train_step(batch)


class BlockingInputTask(Task):
    """The input pipeline of worker `blocked_worker` blocks once it reaches example `block_at`, as a
    hung network filesystem would, while its process stays alive (until a file 'unblock' appears in
    --model_dir)."""

    blocked_worker = 0
    block_at = 64 * 6

    def augment_example(self, features, label, seed):
        if _worker_index() != self.blocked_worker:
            return features, label
        flag = os.path.join(self.config.model_dir, "unblock")

        def wait_for_the_filesystem(position):
            if int(position) >= self.block_at:
                while not os.path.exists(flag):
                    time.sleep(0.1)
            return position

        position = tf.py_function(wait_for_the_filesystem, [seed[1]], tf.int64)
        with tf.control_dependencies([position]):
            return tf.identity(features), label


class BlockingInputOnWorkerOneTask(BlockingInputTask):
    blocked_worker = 1


class KilledOnceTask(Task):
    """Worker 1 kills itself with SIGKILL after its loop that ends at step 4, the first time only
    (a marker file in --model_dir remembers), as an OOM killer or a lost machine would."""

    def derived_metrics(self, metrics):
        marker = os.path.join(self.config.model_dir, "killed_once")
        if _worker_index() == 1 and int(self.global_step.numpy()) >= 4 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {}
