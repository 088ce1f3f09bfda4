"""Turns multi-worker hangs into errors that name the missing worker: a rendezvous before the
strategy exists, a peer watchdog while training runs, and naming the worker in failed collectives.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from engine import exit_codes
from engine.errors import ClusterNotFormed, CollectiveFailed, PeerLost, UserError

EXIT_CODE = exit_codes.PEER_LOST.code


def unreachable_workers(cluster, timeout: float = 1.0) -> list:
    """(type, index, address) of the other workers whose port does not accept a connection."""
    missing = []
    for task_type, index, address in cluster.workers:
        if (task_type, index) == (cluster.task_type, cluster.task_index):
            continue
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
        except OSError:
            missing.append((task_type, index, address))
    return missing


def rendezvous(cluster, timeout: float) -> None:
    """Waits until every other worker's port answers, listening on our own meanwhile.

    MultiWorkerMirroredStrategy's constructor waits for every worker with no bound of its own and
    without letting Python threads run, so a worker that never starts would hang the others
    forever. Meeting here first (the strategy's server takes our port right after) turns that
    into an error after `timeout` seconds that names the missing workers.
    """
    host, _, port = cluster.address.rpartition(":")
    listener = socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("", int(port)))
    except OSError as err:
        listener.close()
        raise UserError(f"cannot listen on this worker's address {cluster.address} from TF_CONFIG: {err}") from None
    listener.listen(64)
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
                connection.close()
            except OSError:
                pass

    thread = threading.Thread(target=accept, name="rendezvous", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        missing = unreachable_workers(cluster)
        while missing and time.monotonic() < deadline:
            time.sleep(0.2)
            missing = unreachable_workers(cluster, timeout=0.5)
    finally:
        stop.set()
        thread.join()
        listener.close()
    if missing:
        who = ", ".join(f"{t}:{i} at {a}" for t, i, a in missing)
        raise ClusterNotFormed(
            f"the cluster did not form within --collective_timeout={timeout:g} s; missing worker(s): "
            f"{who}. Start every worker with the same cluster in TF_CONFIG"
        )


class PeerWatchdog:
    """While training runs, probes the other workers' ports every few seconds. A worker whose
    port has refused connections for `timeout` seconds is dead: the process says which one and
    exits, instead of waiting in a collective (TensorFlow's own heartbeat notices much later,
    whatever --collective_timeout says: docs/strategies.md, what the engine checks). Stop it after
    the last collective: a worker that finished first is not a dead one."""

    def __init__(self, cluster, timeout: float):
        self.cluster = cluster
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self):
        interval = max(0.5, min(2.0, self.timeout / 4))
        first_missing = {}
        while not self._stop.wait(interval):
            now = time.monotonic()
            missing = unreachable_workers(self.cluster, timeout=interval)
            first_missing = {w: first_missing.get(w, now) for w in missing}
            dead = [w for w, since in first_missing.items() if now - since >= self.timeout]
            if dead and not self._stop.is_set():
                who = ", ".join(f"{t}:{i} at {a}" for t, i, a in dead)
                sys.stderr.write(
                    f"\nerror: lost worker(s) {who}: not reachable for {self.timeout:g} s "
                    "(--collective_timeout); the last checkpoint in model_dir is intact, restart "
                    f"every worker with the same flags to resume ({exit_codes.describe(EXIT_CODE)})\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_CODE)


def collective_failure(err, cluster):
    """PeerLost naming the worker a failed collective lost, or CollectiveFailed when none is known."""
    import re

    named = sorted(set(re.findall(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", str(err))))
    lost = [f"{t}:{i}" for t, i in named if (t, int(i)) != (cluster.task_type, cluster.task_index)]
    lost = lost or [f"{t}:{i} at {a}" for t, i, a in unreachable_workers(cluster)]
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    if not lost:
        return CollectiveFailed(
            f"a collective failed ({type(err).__name__}: {first}) with every worker reachable; the last "
            "checkpoint in model_dir is intact, restart every worker with the same flags to resume"
        )
    return PeerLost(
        f"a collective failed, worker(s) lost: {', '.join(lost)} ({type(err).__name__}: {first}); "
        "the last checkpoint in model_dir is intact, restart every worker with the same flags to resume"
    )
