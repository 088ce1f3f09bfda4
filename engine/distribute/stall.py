"""--stall_timeout=S: a worker that completes no training step for S seconds ends with the
*stalled* exit code (engine/exit_codes.py), one line naming the worker(s) that stopped making
progress, and a faulthandler dump of every thread's stack in <model_dir>/stalls/ (not the console).

A daemon thread reads the counters the compiled loops keep (engine/loop.py): steps completed (the
global step), batches taken from the training input, and evaluation batches done. A worker none
of whose counters moved for S seconds (and whose host side did not `touch()` the watch, as the
trainer does around checkpoints) is stalled; fetched == steps means it waits for its input (a hung
input pipeline or filesystem), fetched == steps + 1 that it waits inside the step (a collective
whose peer is missing, or the step itself).

Across workers the thread publishes (step, fetched, a heartbeat count) every `interval` seconds
in the key-value store of TensorFlow's coordination service, which MultiWorkerMirroredStrategy
runs outside the collectives, and reads its peers': a peer whose heartbeat has not moved for S
seconds is frozen (SIGSTOP, a hung host), one whose input is empty is waiting for its data. Each
worker decides on its own and exits: a blocked collective leaves the others no other way out
(timed collectives leave threads behind). Reading two variables every few seconds costs nothing
measurable per step (benchmarks/stall_watch.py).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

from engine import exit_codes

KEY_PREFIX = "ctl_engine_progress"


def counters():
    """(batches fetched, evaluation batches): plain local variables (outside any strategy scope)
    that the compiled loops add to; created here so the loops need no stall logic of their own."""
    import tensorflow as tf

    return (
        tf.Variable(0, dtype=tf.int64, trainable=False, name="stall_watch/fetched"),
        tf.Variable(0, dtype=tf.int64, trainable=False, name="stall_watch/eval_batches"),
    )


def _read(variable) -> int:
    return int(variable.numpy())


class StallWatch:
    """start() before training, stop() after the last step (a finished run is no stalled one)."""

    def __init__(
        self,
        timeout: float,
        model_dir: str,
        steps,
        fetched,
        eval_batches,
        *,
        worker: int = 0,
        num_workers: int = 1,
        out=None,
    ):
        self.timeout, self.model_dir = timeout, model_dir
        self.steps, self.fetched, self.eval_batches = steps, fetched, eval_batches
        self._touched = time.monotonic()
        self.worker, self.num_workers = worker, num_workers
        self.out = out or sys.stderr
        self.interval = max(0.2, min(5.0, timeout / 10))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._heartbeat = 0
        self._kv = None
        if num_workers > 1:
            from engine import compat  # imports TensorFlow, which this module loads only when used

            self._kv = compat.coordination_key_value_store()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def touch(self) -> None:
        """Host-side work that is progress but no step (a checkpoint write): restarts the clock."""
        self._touched = time.monotonic()

    # ---- the watching thread ----
    def _watch(self) -> None:
        last, since = None, time.monotonic()
        peers = {}  # worker -> (last seen record, when it last changed)
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            step, fetched, evaluated = _read(self.steps), _read(self.fetched), _read(self.eval_batches)
            if (step, evaluated) != last:
                last, since = (step, evaluated), now
            since = max(since, self._touched)
            if self._kv is not None:
                self._publish(step, fetched)
                peers = self._peers(peers, now)
            if now - since >= self.timeout and not self._stop.is_set():
                self._end(step, fetched, peers, now)

    def _publish(self, step: int, fetched: int) -> None:
        self._heartbeat += 1
        key = f"{KEY_PREFIX}/{self.worker}"
        value = json.dumps({"step": step, "fetched": fetched, "beat": self._heartbeat})
        try:
            self._kv.delete_config_key_value(key)
            self._kv.set_config_key_value(key, value)
        except Exception:  # noqa: BLE001 - the service may be gone (a lost leader): the reads say so
            pass

    def _peers(self, peers: dict, now: float) -> dict:
        seen = {}
        for worker in range(self.num_workers):
            if worker == self.worker:
                continue
            try:
                record = json.loads(self._kv.get_config_key_value(f"{KEY_PREFIX}/{worker}", 500))
            except Exception:  # noqa: BLE001 - not published yet, or being replaced: no news
                record = None
            previous, changed = peers.get(worker, (None, now))
            if record is not None and record != previous:
                seen[worker] = (record, now)
            else:
                seen[worker] = (previous, changed)
        return seen

    def _end(self, step: int, fetched: int, peers: dict, now: float) -> None:
        causes = []
        for worker, (record, changed) in sorted(peers.items()):
            if now - changed >= self.timeout:
                causes.append(f"worker {worker} (no heartbeat for {now - changed:.0f} s: frozen or unreachable)")
            elif record is not None and record["fetched"] <= record["step"]:
                causes.append(f"worker {worker} (waits for its input at step {record['step']})")
        if fetched <= step:
            causes.insert(0, f"worker {self.worker} (this one: waits for its input at step {step})")
        where = (
            "; stopped making progress: " + ", ".join(causes)
            if causes
            else (f"; this worker waits inside step {step + 1} (a collective or the step itself)")
        )
        dump = self._dump_stacks()
        self.out.write(
            f"\nerror: stalled: no training step completed for {self.timeout:g} s (--stall_timeout) at "
            f"step {step}{where}; every thread's stack is in {dump}; the last checkpoint in model_dir is "
            f"intact; rerun to resume (exit {exit_codes.STALLED.code}: a restart may help)\n"
        )
        self.out.flush()
        if fetched <= step and self.num_workers > 1:
            # The cause: let the waiting peers see it alive and name it before its exit breaks their collective.
            time.sleep(3 * self.interval)
        os._exit(exit_codes.STALLED.code)

    def _dump_stacks(self) -> str:
        directory = os.path.join(self.model_dir, "stalls")
        path = os.path.join(directory, f"worker-{self.worker}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
            return path
        except OSError as err:
            return f"(not written: {err})"
