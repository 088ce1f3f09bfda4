"""Never a hang at start-up: the rendezvous meets only workers of this run (a foreign listener on a
peer's port is named in one line within --collective_timeout), names only the workers never met,
and SIGTERM at any moment of start-up ends every process cleanly (exit 154), none by the default
action. The rendezvous tests run in this process (threads and sockets, no TensorFlow); the others
are real run.py processes on 127.0.0.1, each bounded by timeouts."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from helpers import TASKS_STARTUP, small_flags, start_cli
from engine import exit_codes
from engine.distribute.cluster import Cluster
from engine.distribute.launch import free_ports, worker_tf_configs
from engine.distribute.watchdog import rendezvous
from engine.errors import ClusterNotFormed
from tasks_startup import BUILDING

ARGS = small_flags(model="mlp", train_steps=20, steps_per_loop=5, checkpoint_every=10)
SLOW_BUILD = f"--task={TASKS_STARTUP}:SlowBuildTask"
STOPPED = "stopped: SIGTERM during start-up, before training had state to save"


class _Foreign:
    """A plain Python server on a port: it accepts every connection and sends `reply` (or nothing)."""

    def __init__(self, reply: bytes = b""):
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        self.reply, self.connections = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.connections.append(connection)  # held open: a listener that never answers
            if self.reply:
                connection.sendall(self.reply)

    def close(self):
        self.socket.close()
        for connection in self.connections:
            connection.close()


def _run(cluster, timeout, errors):
    try:
        rendezvous(cluster, timeout)
        errors.append(None)
    except ClusterNotFormed as err:
        errors.append(str(err))


def test_the_rendezvous_names_foreign_listeners_and_only_the_workers_never_met():
    silent, talker = _Foreign(), _Foreign(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    try:
        own, peer, absent = (f"127.0.0.1:{p}" for p in free_ports(3))
        # Another run's worker (another cluster in its TF_CONFIG) on the port our worker:2 should have.
        other = Cluster({"worker": [peer, "127.0.0.1:9"]}, "worker", 0)
        jobs = {"worker": [own, silent.address, talker.address, peer, absent]}
        errors, other_errors = [], []
        threading.Thread(target=_run, args=(other, 6.0, other_errors), daemon=True).start()
        time.sleep(0.3)
        started = time.monotonic()
        _run(Cluster(jobs, "worker", 0), 3.0, errors)
        assert time.monotonic() - started < 3.0 + 6.0  # the timeout, plus at most one probe's wait
        [line] = errors
        assert f"worker:1 at {silent.address} accepts connections but sent no handshake line" in line, line
        assert f"worker:2 at {talker.address} accepts connections but answered b'HTTP/1.1 400" in line, line
        assert f"worker:3 at {peer} is a worker of another run" in line, line
        assert line.endswith(
            f"missing worker(s): worker:4 at {absent}. Start every worker with the same cluster "
            "in TF_CONFIG, each on a free port"
        ), line
        assert line.count("another program holds that port, not a worker of this run") == 3, line
    finally:
        silent.close()
        talker.close()

    # Three workers, the third never starts: worker 0 gives up first and leaves; worker 1, still
    # waiting, must not name the worker it met and that left (it did: its port no longer answered).
    addresses = [f"127.0.0.1:{p}" for p in free_ports(3)]
    errors = {0: [], 1: []}
    threads = [
        threading.Thread(target=_run, args=(Cluster({"worker": addresses}, "worker", i), t, errors[i]), daemon=True)
        for i, t in ((0, 1.5), (1, 4.0))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for i in (0, 1):
        [line] = errors[i]
        assert f"missing worker(s): worker:2 at {addresses[2]}." in line, line
        assert "worker:0 at" not in line and "worker:1 at" not in line, line


def _sigterm_handler_installed(pid: int) -> bool:
    """Whether process `pid` catches SIGTERM now (Linux: the SigCgt mask in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_at_start_up_ends_in_one_line_with_exit_154_and_nothing_written(tmp_path):
    # The earliest moment: run.py's handlers just installed (absl, the flags and TensorFlow not loaded yet).
    with start_cli(*ARGS, f"--model_dir={tmp_path / 'early'}", merge_stderr=False) as early:
        deadline = time.monotonic() + 30
        while not _sigterm_handler_installed(early.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        early.send_signal(signal.SIGTERM)
        early.wait(timeout=60)
    assert early.returncode == exit_codes.STOPPED_AT_STARTUP.code, early.output[-2000:]
    assert early.stderr.strip().splitlines()[-1].startswith(STOPPED), early.stderr[-2000:]

    # Later: the strategy built, the run lock held, the Task building its model.
    model_dir = tmp_path / "building"
    with start_cli(*ARGS, SLOW_BUILD, f"--model_dir={model_dir}", merge_stderr=False) as building:
        building.wait_for_line(BUILDING, timeout=180)
        assert (model_dir / ".lock").exists()
        building.send_signal(signal.SIGTERM)
        building.wait(timeout=30)
    stderr = building.stderr
    assert building.returncode == exit_codes.STOPPED_AT_STARTUP.code, building.output[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(STOPPED) and last.endswith("(exit 154: stopped_at_startup, a restart may help)"), last
    assert "Traceback" not in stderr
    assert not (model_dir / ".lock").exists()  # released on the way out
    assert not list((model_dir / "checkpoints").glob("ckpt-*")) if (model_dir / "checkpoints").exists() else True


@pytest.mark.cluster
def test_a_foreign_listener_on_the_leaders_port_is_named_within_the_timeout(tmp_path):
    """The hang of issue 46: worker 1 took a plain socket server on worker 0's (the coordination
    leader's) port for worker 0 and blocked in MultiWorkerMirroredStrategy() past every timeout."""
    foreign = _Foreign()
    try:
        tf_config = json.loads(worker_tf_configs(2)[1])
        tf_config["cluster"]["worker"][0] = foreign.address
        started = time.monotonic()
        with start_cli(
            "--strategy=multi_worker_mirrored",
            *ARGS,
            "--collective_timeout=5",
            f"--model_dir={tmp_path}",
            env={"TF_CONFIG": json.dumps(tf_config)},
            merge_stderr=False,
        ) as worker:
            worker.wait(timeout=120)
        elapsed = time.monotonic() - started
    finally:
        foreign.close()
    assert worker.returncode == exit_codes.CLUSTER_NOT_FORMED.code, worker.output[-3000:]
    last = worker.stderr.strip().splitlines()[-1]
    assert (
        f"worker:0 at {foreign.address} accepts connections but sent no handshake line: another program "
        "holds that port, not a worker of this run" in last
    ), last
    assert "missing worker" not in last and "Traceback" not in worker.stderr
    assert elapsed < 90, elapsed  # TensorFlow's import, then the 5 s timeout (it hung for good before)


@pytest.mark.cluster
def test_sigterm_to_the_launcher_during_start_up_ends_every_worker_cleanly(tmp_path):
    """Both workers past TensorFlow's rendezvous (whose coordination agent installs a SIGTERM handler
    of its own), building their model: each ends with 154, none by the default action (143) and none
    with peer_lost (150)."""
    args = ["--strategy=multi_worker_mirrored", "--num_workers=2", "--collective_timeout=30"]
    with start_cli(*args, *ARGS, SLOW_BUILD, f"--model_dir={tmp_path}") as launcher:
        launcher.wait_for_line(rf"^\[worker 0\] {BUILDING}", timeout=180)
        launcher.wait_for_line(rf"^\[worker 1\] {BUILDING}", timeout=60)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    output = launcher.output
    assert launcher.returncode == exit_codes.STOPPED_AT_STARTUP.code, output[-3000:]
    for worker in (0, 1):
        assert f"[worker {worker}] {STOPPED}" in output, output[-3000:]
    assert "exited with code 143" not in output and "exited with code 150" not in output, output[-3000:]
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith("launcher: exit 154"), output[-3000:]


@pytest.mark.cluster
def test_a_leader_gone_after_the_rendezvous_ends_the_registration_within_the_timeout(tmp_path):
    """Worker 0 (the leader) answers the rendezvous, then never starts TensorFlow's server: worker
    1's registration with it gives up after --collective_timeout (TensorFlow's own default: an hour)."""
    tf_configs = [json.loads(raw) for raw in worker_tf_configs(2)]
    leader = Cluster(tf_configs[0]["cluster"], "worker", 0)
    errors = []
    threading.Thread(target=_run, args=(leader, 120.0, errors), daemon=True).start()  # leaves once it met worker 1
    started = time.monotonic()
    with start_cli(
        "--strategy=multi_worker_mirrored",
        *ARGS,
        "--collective_timeout=5",
        f"--model_dir={tmp_path}",
        env={"TF_CONFIG": json.dumps(tf_configs[1])},
        merge_stderr=False,
    ) as worker:
        worker.wait(timeout=120)
    elapsed = time.monotonic() - started
    assert errors == [None]  # the leader met worker 1
    assert worker.returncode == exit_codes.CLUSTER_NOT_FORMED.code, worker.output[-3000:]
    last = worker.stderr.strip().splitlines()[-1]
    assert "TensorFlow's registration with the leader worker:0 at" in last and "timed out" in last, last
    assert "Traceback" not in worker.stderr
    assert elapsed < 90, elapsed


@pytest.mark.fast
def test_the_first_start_up_signal_raises_and_a_second_one_gets_the_default_action():
    from engine import startup_signals
    from engine.errors import StoppedAtStartup

    previous = {signum: signal.getsignal(signum) for signum in startup_signals.SIGNALS}
    startup_signals.reset()  # a run.main earlier in this process (tests' run_in_process) handed over
    try:
        startup_signals.install()
        startup_signals.raise_from_now_on()
        with pytest.raises(StoppedAtStartup, match="^SIGINT during start-up, before training had state to save"):
            signal.raise_signal(signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode: it never gets here
        assert all(signal.getsignal(signum) is signal.SIG_DFL for signum in startup_signals.SIGNALS)
        with pytest.raises(StoppedAtStartup):  # swallowed on its way out: the next check raises it again
            startup_signals.check()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        startup_signals.reset()
