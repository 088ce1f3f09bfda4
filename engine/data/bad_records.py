"""Naming the record that stopped an input pipeline: its file, its offset and the cause, in one line.

tf.data's errors name the op's cause ("corrupted record at 497", "Feature: x ... is required") but
not the file, and the training pipeline keeps no per-record Python to name it. So the name is found
after the failure, off the training path: a streamed source's `check(unit)` reads one file again
as the start-up check does (TFRecords: every record read and parsed, a batch at a time; an image:
decoded) and says what is wrong with it. `locate` runs it over the units, the files changed since
the source was loaded first (a shard overwritten while training ran), for at most SEARCH_SECONDS.
"""

from __future__ import annotations

import os
import re
import time

# The longest a failed run reads its files again to name the bad one (then the line says so).
SEARCH_SECONDS = 120.0

# TFRecord framing: length (8 bytes) + its CRC (4), the data, the data's CRC (4).
RECORD_OVERHEAD = 16

_NOISE = ("Graph execution error", "Detected at node", "<stack traces unavailable>", "[[", "Traceback")


def first_cause(err) -> str:
    """The line of TensorFlow's message that says what went wrong: not the graph-location lines,
    nor the Python traceback of the node's creation that TensorFlow appends (`File "run.py", ...`)."""
    if isinstance(err, UnicodeDecodeError):  # TensorFlow could not show a message holding the record's bytes
        return "not a tf.train.Example"
    lines = str(getattr(err, "message", err)).splitlines()
    # The op's own text is flush left; the traceback's frames and code lines are indented.
    causes = [line.strip() for line in lines if line.strip() and not line[0].isspace() and not line.startswith(_NOISE)]
    cause = causes[0] if causes else (lines[0].strip() if lines else type(err).__name__)
    if "Could not parse example input" in cause:
        return "not a tf.train.Example"
    cause = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", cause)  # the op's graph location
    # A failed tf.debugging.Assert: its data (eager "Expected ... Summarized data: b'...'", traced
    # "assertion failed: [...]")
    asserted = re.search(r"Summarized data: (.*)$", cause) or re.match(r"assertion failed: \[(.*)\]", cause)
    if asserted:
        cause = re.sub(r"\bb([\"'])(.*?)\1", r"\2", asserted.group(1)).replace("] [", " ").strip("[]")
    cause = cause.rsplit("Name: <unknown>, ", 1)[-1]  # after "Error in user-defined function passed to ..."
    cause = cause.split(" [Op:")[0].rstrip(". ")
    return re.sub(r"' failed with (.*)$", r" (\1)", cause)[:300]  # "truncated record at B' failed with Read less ..."


def is_undecodable_message(err) -> bool:
    """TensorFlow raised UnicodeDecodeError converting an op's message that held raw record bytes
    (a parse op shows the record it could not parse)."""
    if not isinstance(err, UnicodeDecodeError):
        return False
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}tensorflow{os.sep}" in tb.tb_frame.f_code.co_filename


def locate(source, since: float, seconds: float = SEARCH_SECONDS) -> str | None:
    """'FILE: record N (byte B): cause' for the first bad unit of `source` (train split, then test),
    the units modified after `since` (a time.time()) first; "" when none is found within `seconds`
    (or the source cannot check its units); None when every unit reads back whole."""
    check = getattr(source, "check", None)
    if check is None:
        return ""
    units = {}  # in order, each once (without TEST_GLOB the train files serve both splits)
    for split in (source.train_units, source.test_units):
        parts = [part.tolist() for part in (split if isinstance(split, tuple) else (split,))]
        units.update(dict.fromkeys(zip(*parts)))
    units = list(units)
    units.sort(key=lambda unit: not _changed(unit[0], since))  # stable: the changed ones first
    deadline = time.monotonic() + seconds
    for unit in units:
        if time.monotonic() > deadline:
            return ""
        problem = check(*unit)
        if problem:
            return problem
    return None


def _changed(path, since: float) -> bool:
    try:
        return os.path.getmtime(path.decode() if isinstance(path, bytes) else str(path)) > since
    except OSError:
        return True  # gone: the likeliest culprit
