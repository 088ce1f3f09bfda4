"""The progress line: in place on a terminal, plain lines in a log file."""

from __future__ import annotations

import io

import pytest

from engine.observe.progress import Progress, format_duration

pytestmark = pytest.mark.fast  # every test here runs in seconds: the fast lane (-m fast)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_file_gets_plain_lines():
    stream = io.StringIO()
    progress = Progress(total_steps=100, steps_per_epoch=50, stream=stream)
    progress.update(25, {"loss": 1.5, "accuracy": 0.5}, examples_per_sec=1234.0)
    progress.message("eval   step 25: accuracy 0.6")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("epoch  0.50  step  25/100  loss 1.5000  accuracy 0.5000  1,234 ex/s  ETA")
    assert lines[1] == "eval   step 25: accuracy 0.6" and "\r" not in stream.getvalue()


def test_terminal_updates_in_place():
    stream = _Terminal()
    progress = Progress(total_steps=100, steps_per_epoch=50, stream=stream)
    progress.update(10, {"loss": 1.0}, 10.0)
    progress.update(20, {"loss": 0.5}, 10.0)
    progress.message("saved")
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\nsaved\n")


def test_durations():
    assert format_duration(59.6) == "1:00" and format_duration(3725) == "1:02:05"
