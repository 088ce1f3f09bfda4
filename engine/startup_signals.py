"""SIGTERM / SIGINT from the first line of run.py until training has state to save.

run.py installs these handlers before anything else (before absl, the flags and TensorFlow load),
so a signal at any moment of start-up ends the process cleanly, with the *stopped_at_startup*
exit code (engine/exit_codes.py: retryable, nothing was lost) and one line: the handler raises
StoppedAtStartup where the main thread is (Python runs handlers between bytecodes, so a call into
TensorFlow that holds the GIL, like MultiWorkerMirroredStrategy's constructor, finishes first);
the `finally` blocks on the way out release what start-up took (the run lock, the rendezvous
port). Before run.py's main() can catch it, the handler prints the line and exits at once
(nothing exists yet). The first signal restores the default action, so a second one ends the
process at once (docs/failures.md).

Once the training loop runs, engine/distribute/preemption.py's Watch handles the signals (a
checkpoint at the loop boundary, exit 138) and calls `handover()`; after that (export, the last
lines) these handlers only re-deliver the signal with its default action, as before start-up.
TensorFlow's coordination agent installs a SIGTERM handler of its own while the multi-worker
strategy is built; `reclaim()` takes SIGTERM back right after. No TensorFlow import here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from engine import exit_codes
from engine.errors import StoppedAtStartup

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_state = {"received": None, "raising": False, "over": False}


def install() -> None:
    """The start-up handlers (main thread only: Python allows no other)."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _handle)


def raise_from_now_on() -> None:
    """run.py's main() is running and turns StopRun into its line and exit code."""
    _state["raising"] = True


def _message(name: str) -> str:
    return (
        f"{name} during start-up, before training had state to save: nothing was written or lost; "
        "rerun the same command to start"
    )


def _handle(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _state["over"]:  # after training: the default action, as without these handlers
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state["received"] = name
    for other in SIGNALS:  # a second signal: the default action (the process ends at once)
        signal.signal(other, signal.SIG_DFL)
    if not _state["raising"]:
        code = exit_codes.STOPPED_AT_STARTUP.code
        sys.stderr.write(f"stopped: {_message(name)} (exit {code}: {exit_codes.describe(code)})\n")
        sys.stderr.flush()
        os._exit(code)
    raise StoppedAtStartup(_message(name))


def check() -> None:
    """Raises StoppedAtStartup if a start-up signal came and its exception was swallowed on the way."""
    if _state["received"] and not _state["over"]:
        raise StoppedAtStartup(_message(_state["received"]))


def reclaim() -> None:
    """Takes SIGTERM/SIGINT back from a handler TensorFlow's C++ installed (the coordination agent's
    SIGTERM notifier), if ours were in place and no signal came yet."""
    if threading.current_thread() is not threading.main_thread() or _state["received"] or _state["over"]:
        return
    for signum in SIGNALS:
        if signal.getsignal(signum) is _handle:
            signal.signal(signum, _handle)


def handover() -> None:
    """The training loop's Watch takes the signals over; afterwards the default actions apply."""
    _state["over"] = True


def reset() -> None:
    """For tests in one process: back to the state before start-up."""
    _state.update(received=None, raising=False, over=False)
