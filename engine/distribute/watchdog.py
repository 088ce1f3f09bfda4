"""Turns multi-worker hangs into errors that name the missing worker: a rendezvous before the
strategy exists, a peer watchdog while training runs, and naming the worker in failed collectives.
"""

from __future__ import annotations

import hashlib
import json
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


HANDSHAKE = b"ctl-engine-rendezvous/1"  # the first word of both lines of the rendezvous exchange
_ANSWER_SECONDS = 5.0  # how long one probe waits for a peer's answer line


def run_token(cluster) -> str:
    """The run's token: a hash of TF_CONFIG's cluster, which every worker of this run holds the
    same (and a worker of another run, or another program, does not)."""
    text = json.dumps(cluster.jobs, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _line(token: str, task: str) -> bytes:
    return b" ".join((HANDSHAKE, token.encode(), task.encode())) + b"\n"


def _read_line(connection, seconds: float) -> bytes:
    """Up to one line (at most 256 bytes) from `connection` within `seconds`; b"" if none came."""
    connection.settimeout(seconds)
    data = b""
    deadline = time.monotonic() + seconds
    while b"\n" not in data and len(data) < 256 and time.monotonic() < deadline:
        try:
            chunk = connection.recv(256 - len(data))
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _parse(data: bytes):
    """(token, task) of a handshake line, or None when it is not one."""
    words = data.strip().split(b" ")
    if len(words) != 3 or words[0] != HANDSHAKE:
        return None
    return words[1].decode("ascii", "replace"), words[2].decode("ascii", "replace")


def probe(address: str, token: str, me: str, seconds: float = _ANSWER_SECONDS):
    """Meets the worker at `address`: sends our handshake line, reads its answer. Returns
    ("ok", task), ("refused", reason) when nothing accepts there (not started yet), or
    ("foreign", what it answered) when something listens there that is no worker of this run."""
    host, _, port = address.rpartition(":")
    try:
        connection = socket.create_connection((host.strip("[]"), int(port)), timeout=min(1.0, seconds))
    except OSError as err:
        return "refused", str(err)
    with connection:
        try:
            connection.sendall(_line(token, me))
        except OSError:
            return "refused", "the connection closed"  # a listener closing: look again
        answer = _read_line(connection, seconds)
    parsed = _parse(answer)
    if parsed is None:
        said = f"answered {answer[:40]!r}" if answer else "sent no handshake line"
        return "foreign", f"accepts connections but {said}"
    if parsed[0] != token:
        return "foreign", f"is a worker of another run (its TF_CONFIG names another cluster: token {parsed[0]})"
    return "ok", parsed[1]


def rendezvous(cluster, timeout: float, check=None) -> None:
    """Meets every other worker of this run, each proven by a handshake, before TensorFlow's.

    MultiWorkerMirroredStrategy's constructor waits for every worker with no bound of its own and
    holding the GIL (no Python thread or signal handler runs), and it takes any program that
    accepts a connection on a peer's port for that peer. So the workers meet here first: each
    listens on its own port (the strategy's server takes it right after) and answers a handshake
    line (HANDSHAKE, run_token, the sender's task) with its own; a worker
    counts a peer as met once one exchange went through, either way round (the side that answers
    sends its line before it counts the other, so the asker has it whatever happens next). After
    `timeout` seconds it names, in one line, the workers never met and the addresses where
    something that is no worker of this run listens. `check()` is called between probes (the
    start-up signal check: engine/startup_signals.py).
    """
    token, me = run_token(cluster), f"{cluster.task_type}:{cluster.task_index}"
    peers = {f"{t}:{i}": a for t, i, a in cluster.workers if (t, i) != (cluster.task_type, cluster.task_index)}
    met, lock = set(), threading.Lock()
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

    def answer(connection):
        with connection:
            parsed = _parse(_read_line(connection, 1.0))
            if parsed is None:
                return  # no engine worker (a port scan, say): no answer
            try:
                connection.sendall(_line(token, me))  # another run's worker learns that it is one
            except OSError:
                return
            if parsed[0] == token and parsed[1] in peers:
                with lock:
                    met.add(parsed[1])

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            answer(connection)

    thread = threading.Thread(target=accept, name="rendezvous", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    foreign = {}  # task -> what its address answered (the latest look)
    try:
        while True:
            with lock:
                todo = [task for task in peers if task not in met]
            if not todo or time.monotonic() >= deadline:
                break
            for task in todo:
                if check is not None:
                    check()
                seconds = max(0.2, min(_ANSWER_SECONDS, deadline - time.monotonic()))
                outcome, detail = probe(peers[task], token, me, seconds)
                if outcome == "ok" and detail == task:
                    with lock:
                        met.add(task)
                    foreign.pop(task, None)
                elif outcome == "ok":
                    foreign[task] = f"answers as worker {detail} of this run, not as {task}"
                elif outcome == "foreign":
                    foreign[task] = detail
                else:
                    foreign.pop(task, None)
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
        listener.close()
    with lock:
        missing = [task for task in peers if task not in met]
    if missing:
        parts = [
            f"{task} at {peers[task]} {foreign[task]}: another program holds that port, not a worker of this run"
            for task in missing
            if task in foreign
        ]
        absent = [f"{task} at {peers[task]}" for task in missing if task not in foreign]
        if absent:
            parts.append("missing worker(s): " + ", ".join(absent))
        raise ClusterNotFormed(
            f"the cluster did not form within --collective_timeout={timeout:g} s; "
            + "; ".join(parts)
            + ". Start every worker with the same cluster in TF_CONFIG, each on a free port"
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
