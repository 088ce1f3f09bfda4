"""The exceptions that end a run on purpose: run.py prints one line and exits with their code."""


class StopRun(Exception):
    """Ends the run without a traceback: run.py prints `<prefix>: <message>` and exits exit_code.

    (No custom __init__: autograph re-creates exceptions raised while tracing a step as
    type(err)(augmented message), and fails on any other constructor.)"""

    exit_code = 1
    prefix = "error"

    @property
    def message(self) -> str:
        """The message as raised: without the "in user code:" trace autograph adds when the
        error was raised while a step was being traced."""
        metadata = getattr(self, "ag_error_metadata", None)
        return getattr(metadata, "cause_message", None) or str(self)


class ExtraFailed(StopRun):
    """Host-side work after training steps (summaries, best checkpoint, export) raised: the
    checkpoint written before it is kept; run.py prints one line and exits 1 (a bug to fix)."""

    exit_code = 1


class UserError(StopRun):
    """A bad flag, file or setup. run.py prints its message as one line and exits 2.

    The message names the bad input and says what to do; no traceback is shown.
    """

    exit_code = 2


class Preempted(StopRun):
    """SIGTERM/SIGINT: the run saved a checkpoint at a loop boundary; rerun the command to resume."""

    exit_code = 3
    prefix = "preempted"


class NonFiniteLoss(StopRun):
    """A NaN/Inf loss or gradient with --on_nonfinite=stop; the last good checkpoint is kept."""

    exit_code = 4
