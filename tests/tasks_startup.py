"""A Task whose start-up takes long enough to be signalled at a known moment: tests/test_startup.py
loads it with --task=tests/tasks_startup.py:SlowBuildTask."""

from __future__ import annotations

import time

from engine.task import Task

BUILDING = "SlowBuildTask: building the model"  # printed (flushed) before the wait


class SlowBuildTask(Task):
    """build_model says so on stdout, then waits 120 s: the strategy exists (under
    multi_worker_mirrored, TensorFlow's coordination agent has been set up), the run lock is held,
    and no training state has been saved yet."""

    def build_model(self):
        print(BUILDING, flush=True)
        time.sleep(120)
        return super().build_model()
