"""TensorFlow's C++ start-up lines, each shown at most once and its INFO lines only on request.

Importing TensorFlow 2.21 writes C++ INFO lines (`I0000 ... port.cc] oneDNN custom operations are
on ...`, `cudart_stub.cc] Could not find cuda drivers ...`) straight to file descriptor 2, before
absl's C++ logging is initialised, so TF_CPP_MIN_LOG_LEVEL does not reach them; two of its
libraries print the same lines, so a run began with each of them twice. `import_tensorflow`
imports TensorFlow (and Keras) with descriptor 2 pointed at a temporary file, then writes back each
distinct line that is not C++ INFO chatter (warnings and errors stay visible, once each). With
`show_info` (run.py: `--verbosity=0` or higher given on the command line) nothing is hidden.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

# "I0000 00:00:1796411445.967368   10427 port.cc:153] ..." and absl's preamble to such lines.
_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\] ")
_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ ")
_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def kept_lines(text: str, show_info: bool = False) -> list[str]:
    """The lines of captured start-up output to show: every distinct line once, in order, without
    the C++ INFO lines and their preamble unless `show_info`."""
    kept, seen = [], set()
    for line in text.splitlines():
        message = _PREFIX.sub("", line)  # the same line from two libraries differs only in its time
        if message in seen or (not show_info and (_INFO_LINE.match(line) or line.strip() == _PREAMBLE)):
            continue
        seen.add(message)
        kept.append(line)
    return kept


def import_tensorflow(show_info: bool = False) -> None:
    """Imports tensorflow and keras with their C++ start-up output filtered (see the module doc)."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import keras  # noqa: F401  (imports tensorflow)
            import tensorflow  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = kept_lines(capture.read().decode("utf-8", "replace"), show_info)
            if lines:
                print("\n".join(lines), file=sys.stderr, flush=True)
