"""Local multi-worker launcher: `run.py --strategy=multi_worker_mirrored --num_workers=N` with no
TF_CONFIG starts N workers on 127.0.0.1 (like torchrun's standalone mode).

Each worker gets free ports and its own consistent TF_CONFIG; output lines are prefixed with
"[worker i]"; the first worker to fail stops the others (SIGTERM, then SIGKILL after a grace
period); Ctrl-C or SIGTERM is passed on to every worker (they save a checkpoint and exit as
PREEMPTED, see engine/distribute/preemption.py); the exit code is the first non-zero one. With max_restarts=K a
failure a restart may cure (engine/exit_codes.py: >= 128, or killed by a signal) starts the whole
cluster again on fresh ports, up to K times; the workers resume from the last checkpoint and the
chief logs the count as the TensorBoard scalar `restarts`. No TensorFlow is imported here.

With `evaluator=True` (`--evaluator`) one more process gets TF_CONFIG task type `evaluator` (its
output prefixed "[evaluator]"): it evaluates each checkpoint beside the workers and is no member
of their collectives, so its failure stops nobody; the launcher waits for it after the workers
finish (it stops at the run's last step). The exit code is the first failed worker's, else the
evaluator's.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from engine import exit_codes
from engine.controller import checkpoint_names

GRACE_SECONDS = 10.0  # for the other workers, after one failed
RESTARTS_ENV = "CTL_ENGINE_RESTARTS"  # tells a restarted cluster's workers how many restarts came before
PREEMPTION_GRACE_SECONDS = 120.0  # after Ctrl-C/SIGTERM: time to finish the loop and save


def free_ports(count: int, host: str = "127.0.0.1") -> list:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_tf_configs(num_workers: int, host: str = "127.0.0.1", evaluator: bool = False) -> list:
    """One TF_CONFIG per worker, then (evaluator=True) one for the evaluator task."""
    ports = free_ports(num_workers + evaluator, host)
    cluster = {"worker": [f"{host}:{port}" for port in ports[:num_workers]]}
    if evaluator:
        cluster["evaluator"] = [f"{host}:{ports[-1]}"]
    tasks = [("worker", i) for i in range(num_workers)] + ([("evaluator", 0)] if evaluator else [])
    return [json.dumps({"cluster": cluster, "task": {"type": t, "index": i}}) for t, i in tasks]


def _relay(index: int, name: str, process, lock: threading.Lock, out, exits: queue.Queue) -> None:
    """Copies a process's output, prefixed; then reports its exit, so exits arrive in order."""
    for line in process.stdout:
        with lock:
            out.write(f"[{name}] {line}")
            out.flush()
    exits.put((index, process.wait()))


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated()


def _stop(processes, sig=signal.SIGTERM, grace: float = GRACE_SECONDS) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(sig)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def launch(num_workers: int, args: list, script: str, out=None, evaluator: bool = False, max_restarts: int = 0) -> int:
    """Runs `python script args...` as `num_workers` workers (and an evaluator), restarting the
    whole cluster up to `max_restarts` times after a retryable failure; returns 0 when the run
    finished, else the last failing exit code (a worker's, else the evaluator's)."""
    out = out or sys.stdout
    restarts = 0
    while True:
        code, interrupted = _launch_once(num_workers, args, script, out, evaluator, restarts)
        if code == 0 or interrupted or restarts >= max_restarts or not exit_codes.retryable(code):
            if code and max_restarts and not exit_codes.retryable(code):
                out.write(f"launcher: exit {code} ({exit_codes.describe(code)}): not restarted\n")
            if code:
                out.write(resume_line(code, args) + "\n")
            return code
        restarts += 1
        out.write(
            f"launcher: restart {restarts} of {max_restarts} after exit {code} "
            f"({exit_codes.describe(code)}); the workers resume from the last checkpoint\n"
        )
        out.flush()


def resume_line(code: int, args: list) -> str:
    """The launcher's last line after a failed run: the newest checkpoint on disk and how to go on."""
    model_dir = next((a.split("=", 1)[1] for a in reversed(args) if a.startswith("--model_dir=")), "")
    directory = os.path.join(model_dir, "checkpoints")
    steps = checkpoint_names.steps_with_files(os.listdir(directory) if os.path.isdir(directory) else [])
    todo = "rerun the same command" if exit_codes.retryable(code) else "fix the cause, then rerun the same command"
    if not steps:
        return (
            f"launcher: exit {code} ({exit_codes.describe(code)}); no checkpoint was written yet: {todo} to start again"
        )
    newest = os.path.join(directory, f"{checkpoint_names.PREFIX}-{max(steps)}")
    return (
        f"launcher: exit {code} ({exit_codes.describe(code)}); the newest checkpoint is "
        f"{newest} (checkpoints are written whole): {todo} to resume "
        f"from the newest one that reads back (--model_dir={model_dir})"
    )


def _launch_once(num_workers: int, args: list, script: str, out, evaluator: bool, restarts: int):
    """One start of the cluster: (exit code, whether the launcher itself was interrupted)."""
    lock = threading.Lock()
    exits = queue.Queue()
    processes, relays = [], []
    out.write(f"launching {num_workers} local workers" + (" and an evaluator" if evaluator else "") + " on 127.0.0.1\n")
    exit_code, evaluator_code, interrupted = 0, 0, False
    # From before the first worker starts (run.py's start-up handlers would end only this process):
    # SIGTERM and Ctrl-C stop every worker started so far.
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    try:
        _start(num_workers, args, script, out, evaluator, restarts, lock, exits, processes, relays)
        exit_code, evaluator_code = _wait(num_workers, out, lock, exits, processes)
    except (KeyboardInterrupt, _Terminated) as stop:
        sig = signal.SIGTERM if isinstance(stop, _Terminated) else signal.SIGINT
        with lock:
            out.write(f"launcher: {signal.Signals(sig).name}; stopping all workers\n")
        _stop(processes, sig, grace=PREEMPTION_GRACE_SECONDS)  # workers save a checkpoint, exit as PREEMPTED
        exit_code = next((p.returncode for p in processes if p.returncode), 128 + sig)
        interrupted = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for relay in relays:
        relay.join(timeout=5)
    code = exit_code or evaluator_code
    return (128 - code if code < 0 else code), interrupted  # killed by signal N: 128 + N, as a shell says


def _start(num_workers, args, script, out, evaluator, restarts, lock, exits, processes, relays) -> None:
    """Starts the workers (and the evaluator), each with its TF_CONFIG and a relay of its output."""
    for index, tf_config in enumerate(worker_tf_configs(num_workers, evaluator=evaluator)):
        name = f"worker {index}" if index < num_workers else "evaluator"
        env = dict(os.environ, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
        if restarts:
            env[RESTARTS_ENV] = str(restarts)
        process = subprocess.Popen(
            [sys.executable, script, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        processes.append(process)
        relay = threading.Thread(target=_relay, args=(index, name, process, lock, out, exits), daemon=True)
        relay.start()
        relays.append(relay)


def _wait(num_workers, out, lock, exits, processes):
    """(the first failed worker's code, the evaluator's code): waits until every process ended, or
    stops the others at the first failure."""
    exit_code, evaluator_code, running = 0, 0, len(processes)
    while running:
        index, code = exits.get()
        running -= 1
        if index == num_workers:  # the evaluator: nobody waits for it or fails with it
            evaluator_code = code
            if code != 0:
                with lock:
                    out.write(f"launcher: the evaluator exited with code {code}; the workers go on\n")
            continue
        if code != 0:
            exit_code = code
            with lock:
                out.write(f"launcher: worker {index} exited with code {code}; stopping the others\n")
            _stop(processes)
            break
    return exit_code, evaluator_code
