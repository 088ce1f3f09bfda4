"""Tasks whose model has several outputs (tests/test_outputs.py): examples/two_heads.py's and its variants."""

from __future__ import annotations

from engine.task import Task
from examples.two_heads import TwoHeadedTask


class TwoHeadedByIndexTask(TwoHeadedTask):
    classifier_output = 0


class TwoHeadedUnnamedTask(TwoHeadedTask):
    """Says nothing about its outputs: the pictures are off, with one banner line."""

    classifier_output = None


class FailingSummaryTask(Task):
    """Its after_eval raises on a line of this file: the run names the line and keeps the traceback."""

    def after_eval(self, step, writer):
        raise KeyError("no such summary")  # LINE OF THE FAILURE
