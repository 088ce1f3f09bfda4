"""Tasks for tests/test_run_dir.py (loaded with --task=tests/tasks_rundir.py:ClassName)."""

from __future__ import annotations

import os
import time

from engine.task import Task

GO_FILE_ENV = "CTL_TEST_GO_FILE"  # the file WaitingTask waits for
WAIT_SECONDS = 120.0  # bounded: a test that forgets the file still ends


class WaitingTask(Task):
    """The default Task, whose build_model waits until the file named by $CTL_TEST_GO_FILE exists:
    the run then holds its --model_dir's lock for as long as a test needs."""

    def build_model(self):
        go_file = os.environ.get(GO_FILE_ENV, "")
        deadline = time.monotonic() + WAIT_SECONDS
        while go_file and not os.path.exists(go_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        return super().build_model()
