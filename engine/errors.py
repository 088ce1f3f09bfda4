"""The exceptions that end a run on purpose: run.py prints one line and exits with their code
(engine/exit_codes.py is the one table of codes)."""

from engine import exit_codes


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
        message = getattr(metadata, "cause_message", None) or str(self)
        # Raised in a nested trace (the XLA-compiled step in the loop), the cause names the class.
        return message.removeprefix(f"{type(self).__name__}: ")


class ExtraFailed(StopRun):
    """Host-side work after training steps (summaries, best checkpoint, export) raised: the
    checkpoint written before it is kept; run.py prints one line and exits as BUG (a bug to fix)."""

    exit_code = exit_codes.BUG.code


class UserError(StopRun):
    """A bad flag, file or setup. run.py prints its message as one line and exits as BAD_INPUT.

    The message names the bad input and says what to do; no traceback is shown.
    """

    exit_code = exit_codes.BAD_INPUT.code


class StepFailed(UserError):
    """A Task method (train_step, eval_step, ...) raised while TensorFlow traced it: a mistake in
    the step, the same on every rerun. run.py prints one line naming the method and the user's
    file:line and exits as BAD_INPUT; `traceback_text` holds the whole traceback (for errors/)."""

    traceback_text = ""


class StorageFailed(StopRun):
    """A write into --model_dir failed (disk full, read-only, no permission): engine/controller/
    storage.py names what failed where and the intact checkpoint; a rerun on the same full or
    read-only directory fails again (permanent until the storage is fixed)."""

    exit_code = exit_codes.STORAGE_FAILED.code


class Preempted(StopRun):
    """SIGTERM/SIGINT: the run saved a checkpoint at a loop boundary; rerun the command to resume."""

    exit_code = exit_codes.PREEMPTED.code
    prefix = "preempted"


class StoppedAtStartup(StopRun):
    """SIGTERM/SIGINT before training had state to save (engine/startup_signals.py): nothing lost; rerun."""

    exit_code = exit_codes.STOPPED_AT_STARTUP.code
    prefix = "stopped"


class NonFiniteLoss(StopRun):
    """A NaN/Inf loss or gradient with --on_nonfinite=stop; the last good checkpoint is kept."""

    exit_code = exit_codes.NON_FINITE.code


class PeerLost(StopRun):
    """A worker of the cluster died or became unreachable while training (a restart may help)."""

    exit_code = exit_codes.PEER_LOST.code


class CollectiveFailed(StopRun):
    """A collective failed or timed out with no worker known to be lost (a restart may help)."""

    exit_code = exit_codes.COLLECTIVE_FAILED.code


class ClusterNotFormed(StopRun):
    """Not every worker of TF_CONFIG answered at start-up within --collective_timeout."""

    exit_code = exit_codes.CLUSTER_NOT_FORMED.code


class Stalled(StopRun):
    """No training step completed for --stall_timeout seconds (engine/distribute/stall.py exits
    with this code from its own thread; the class names the code for the table's tests)."""

    exit_code = exit_codes.STALLED.code
