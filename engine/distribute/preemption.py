"""SIGTERM / SIGINT: finish the compiled loop in flight, checkpoint, exit as preempted (engine.errors.Preempted).

Python runs signal handlers only in the main thread and only between Python bytecodes, so a
signal that arrives while a compiled loop (one tf.function call of --steps_per_loop steps) runs
is handled when that call returns: the handler only sets a flag, and the trainer checks it at
each loop boundary. The first signal also restores the default handlers, so a second SIGTERM or
SIGINT kills the process at once (the previous checkpoint stays usable: TensorFlow writes a new
checkpoint's files first and rewrites the `checkpoint` file that names the latest one, atomically,
only when they are complete).

With several workers the stop is decided from an all-reduced flag (`Watch.stop_requested`: one
scalar SUM per loop, taken by every worker at the same loop boundary), so under
multi_worker_mirrored all workers stop at the same step even when only one of them was signalled
(invariant 5). In one process every replica already shares the Python flag, so no collective is
run there (an extra collective would also shift the collective instance keys that MirroredStrategy
instances in one process share, which broke other strategies built later in a test process).
TensorFlow's PreemptionCheckpointHandler is not used: it covers only multi-worker and TPU
strategies, wants to run each step itself (`handler.run(fn)`) and, on some platforms, exits the
process on its own terms; this flag gives every strategy the same behaviour and exit code.
"""

from __future__ import annotations

import signal
import threading

import tensorflow as tf

from engine import startup_signals

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Watch:
    """Context manager: installs the handlers on enter (main thread only), restores them on exit."""

    def __init__(self, strategy: tf.distribute.Strategy, num_workers: int = 1):
        self.signal_name: str | None = None
        self._previous: dict = {}
        self._any = _make_all_reduce_flag(strategy) if num_workers > 1 else None

    def __enter__(self) -> "Watch":
        startup_signals.check()  # a start-up signal whose exception was swallowed: stop before training
        startup_signals.handover()
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        for other in SIGNALS:  # a second signal: the default action (the process ends at once)
            signal.signal(other, signal.SIG_DFL)

    def stop_requested(self) -> bool:
        """Whether any worker was signalled. Every worker must call this at the same boundary."""
        if self._any is None:
            return self.signal_name is not None
        local = tf.constant(0.0 if self.signal_name is None else 1.0)
        return bool(self._any(local).numpy() > 0)


def _make_all_reduce_flag(strategy):
    @tf.function
    def any_flag(local):
        per_replica = strategy.run(lambda: tf.identity(local))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return any_flag
