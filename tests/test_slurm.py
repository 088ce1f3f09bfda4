"""SLURM natively (engine/distribute/slurm.py, deploy/slurm.sbatch). Without daemons: the hostlist
and tasks-per-node expansion, the TF_CONFIG built from SLURM's variables, the per-job ports, the
refusals and the batch script's exit codes. Then on a real one-node SLURM cluster (Debian's
slurm-wlm and munge, started by a module fixture and stopped by PID): `srun -n2` with no TF_CONFIG
trains 2 workers equal to one replica; `scancel` ends both tasks with 138 and a checkpoint; the batch
script requeues a preempted job, which resumes and ends bitwise equal to an undisturbed run.

The daemon tests fail (never skip) where slurm-wlm or munge is missing: .ci/run installs them."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from helpers import REPO, TASKS_FAULTS, TASKS_STARTUP, checkpoint_state, exported_by_name, run_cli, trained_by_name
from engine import exit_codes
from engine.distribute import slurm
from engine.distribute.cluster import parse_tf_config
from engine.distribute.launch import free_ports
from engine.errors import UserError
from tasks_startup import BUILDING

SBATCH = os.path.join(REPO, "deploy", "slurm.sbatch")
DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
SLOW = "SlowTrainingTask"  # the default step, slower: a job stays running long enough to be cancelled
FLAGS = [
    "--dataset=synthetic",
    "--synthetic_train_examples=512",
    "--synthetic_test_examples=128",
    "--model=mlp",
    "--global_batch=64",
    "--train_steps=24",
    "--steps_per_loop=2",
    "--checkpoint_every=2",
    "--seed=7",
    "--collective_timeout=60",
    f"--task={TASKS_FAULTS}:{SLOW}",
    "--export",
]


def _step_env(**overrides) -> dict:
    """The variables srun gives task 0 of a 2-task step on one node (as measured under srun -n2)."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "vm",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "vm",
        "SLURM_TASKS_PER_NODE": "2",
    }
    env.update(overrides)
    return env


# ----- without daemons -----


@pytest.mark.fast
@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("vm", ["vm"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
        ("rack1-[098-100],login.example.org", ["rack1-098", "rack1-099", "rack1-100", "login.example.org"]),
    ],
)
def test_hostlist_expansion(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.fast
@pytest.mark.parametrize("text", ["n[1-", "n[3-1]", "n[a]", "", "n]1[", "n[[1]]"])
def test_bad_hostlists_are_one_line(text):
    with pytest.raises(UserError, match="SLURM node list"):
        slurm.expand_hostlist(text)


@pytest.mark.fast
def test_tasks_per_node_expansion():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_tasks_per_node("4") == [4]
    assert slurm.expand_tasks_per_node("1,2(x2)") == [1, 2, 2]
    with pytest.raises(UserError, match="not like '2\\(x3\\),1'"):
        slurm.expand_tasks_per_node("2(3)")


@pytest.mark.fast
def test_tasks_are_placed_as_srun_places_them():
    assert slurm.place_tasks([2, 2, 1]) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert slurm.place_tasks([2, 2, 1], "block:cyclic") == slurm.place_tasks([2, 2, 1])
    assert slurm.place_tasks([2, 2, 1], "cyclic") == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert slurm.place_tasks([3, 3], "plane", 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    with pytest.raises(UserError, match="block, cyclic and plane"):
        slurm.place_tasks([2], "arbitrary")


@pytest.mark.fast
def test_the_tf_config_of_a_multi_node_step():
    """Task 3 of `node[1-2],gpu5` with `2(x2),1`: worker i is SLURM_PROCID i, worker 0 the chief."""
    env = _step_env(
        SLURM_PROCID="3",
        SLURM_NODEID="1",
        SLURM_LOCALID="1",
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_NODELIST="node[1-2],gpu5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
    )
    spec = json.loads(slurm.configure("multi_worker_mirrored", 0, env))
    first, second = slurm.step_ports(4242, 0)[:2]
    assert spec == {
        "cluster": {
            "worker": [
                f"node1:{first}",
                f"node1:{second}",
                f"node2:{first}",
                f"node2:{second}",
                f"gpu5:{first}",
            ]
        },
        "task": {"type": "worker", "index": 3},
    }
    cluster = parse_tf_config(json.dumps(spec))  # the same validation as a written TF_CONFIG
    assert cluster.num_workers == 5 and not cluster.is_chief
    reserved = slurm.tf_config({**env, "SLURM_STEP_RESV_PORTS": "12000-12001"})
    assert reserved["cluster"]["worker"][:2] == ["node1:12000", "node1:12001"]


@pytest.mark.fast
def test_each_job_step_gets_its_own_ports_in_the_documented_range():
    """Jobs with nearby ids run at the same time on one node: their port blocks must not overlap."""
    seen = {}
    for job in range(1000, 1000 + slurm._BLOCKS // slurm.STEPS_PER_JOB):
        for step in range(slurm.STEPS_PER_JOB):
            ports = slurm.step_ports(job, step)
            assert slurm.PORT_MIN <= min(ports) and max(ports) < slurm.PORT_MAX <= 32768
            for port in ports:
                assert port not in seen, (port, seen.get(port), (job, step))
                seen[port] = (job, step)
    assert slurm.step_ports(77, 0) == slurm.step_ports(77, 0)  # a requeued job keeps its id and ports


@pytest.mark.fast
@pytest.mark.parametrize(
    "strategy, num_workers, overrides, message",
    [
        ("mirrored", 0, {}, "srun started 2 tasks of --strategy=mirrored: each would train alone"),
        ("default", 0, {}, "use --strategy=multi_worker_mirrored"),
        ("multi_worker_mirrored", 3, {}, "--num_workers=3 but the srun step has 2 tasks"),
        (
            "multi_worker_mirrored",
            0,
            {"SLURM_STEP_NUM_TASKS": None, "SLURM_STEP_ID": None},
            "is no task of an srun step: start the workers with `srun python run.py",
        ),
        ("multi_worker_mirrored", 0, {"SLURM_STEP_TASKS_PER_NODE": "3"}, "disagree; set TF_CONFIG yourself"),
        ("multi_worker_mirrored", 0, {"SLURM_STEP_NODELIST": "a,b"}, "(2 nodes)"),
        ("multi_worker_mirrored", 0, {"SLURM_LOCALID": "1"}, "runs as local task 1 of node 0"),
        ("multi_worker_mirrored", 0, {"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is not a task of this step of 2"),
        ("multi_worker_mirrored", 0, {"SLURM_DISTRIBUTION": "arbitrary"}, "block, cyclic and plane"),
        (
            "multi_worker_mirrored",
            0,
            {"SLURM_STEP_RESV_PORTS": "12000"},
            "SLURM_STEP_RESV_PORTS=12000 has 1 ports",
        ),
    ],
)
def test_steps_that_do_not_fit_are_refused_in_one_line(strategy, num_workers, overrides, message):
    env = {k: v for k, v in _step_env(**overrides).items() if v is not None}
    with pytest.raises(UserError) as raised:
        slurm.configure(strategy, num_workers, env)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.fast
def test_slurm_is_left_alone_where_it_has_nothing_to_say():
    assert slurm.configure("multi_worker_mirrored", 0, _step_env(TF_CONFIG='{"cluster": {}}')) is None
    one_task = _step_env(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    assert slurm.configure("mirrored", 0, one_task) is None
    assert slurm.configure("multi_worker_mirrored", 2, one_task) is None  # the local launcher inside
    assert slurm.configure("multi_worker_mirrored", 0, {}) is None  # no SLURM: TF_CONFIG's own error
    batch_shell = {k: v for k, v in _step_env().items() if "STEP" not in k}
    assert slurm.configure("mirrored", 0, batch_shell) is None
    assert slurm.configure("multi_worker_mirrored", 2, batch_shell) is None


@pytest.mark.fast
def test_a_taken_port_is_refused_before_a_worker_waits_on_it():
    env = _step_env()
    port = int(slurm.tf_config(env)["cluster"]["worker"][0].rsplit(":", 1)[1])
    listener = socket.socket()
    try:
        listener.bind(("", port))
        listener.listen()
        with pytest.raises(UserError, match=f"port {port} .* is taken on this node"):
            slurm.configure("multi_worker_mirrored", 0, env)
    finally:
        listener.close()


@pytest.mark.fast
def test_run_py_refuses_a_multi_task_step_of_another_strategy_before_tensorflow_loads():
    started = time.monotonic()
    result = run_cli("--strategy=mirrored", "--dataset=synthetic", "--train_steps=1", env=_step_env(), timeout=60)
    assert result.returncode == exit_codes.BAD_INPUT.code, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: srun started 2 tasks of --strategy=mirrored")
    assert "Traceback" not in result.stderr and time.monotonic() - started < 30


def _script_lists():
    with open(SBATCH) as f:
        text = f.read()
    lists = dict(re.findall(r'^(RETRYABLE_EXIT_CODES|PERMANENT_EXIT_CODES)="([\d ]+)"$', text, re.M))
    return text, {name: {int(c) for c in codes.split()} for name, codes in lists.items()}


@pytest.mark.fast
def test_the_batch_script_requeues_exactly_the_tables_retryable_codes():
    text, lists = _script_lists()
    assert lists == {
        "RETRYABLE_EXIT_CODES": set(exit_codes.RETRYABLE),
        "PERMANENT_EXIT_CODES": set(exit_codes.PERMANENT),
    }
    function = re.search(r"^retryable\(\) \{\n.*?^\}$", text, re.M | re.S).group(0)
    codes = sorted({c.code for c in exit_codes.CODES} | {3, 126, 127, 128, 130, 137, 143, 200})
    shell = "".join(f"{name}='{' '.join(map(str, sorted(v)))}'\n" for name, v in lists.items()) + function + "\n"
    shell += "".join(f"retryable {code} && echo {code}\n" for code in codes)
    requeued = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=10, check=True)
    assert {int(c) for c in requeued.stdout.split()} == {c for c in codes if c and exit_codes.retryable(c)}
    options = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert "--requeue" in options and "--open-mode=append" in options
    lead = [o for o in options if o.startswith("--signal=")]
    assert len(lead) == 1 and re.fullmatch(r"--signal=TERM@\d+", lead[0]), lead  # no "B:": the tasks get it
    assert re.search(r"^srun .*python run\.py --strategy=multi_worker_mirrored \"\$@\"$", text, re.M)
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    subprocess.run(["bash", "-n", SBATCH], check=True, timeout=10)


@pytest.mark.fast
def test_the_docs_name_the_port_range_the_code_uses():
    with open(os.path.join(REPO, "docs", "strategies.md")) as f:
        docs = f.read()
    assert f"block of {slurm.PORTS_PER_STEP} ports in {slurm.PORT_MIN}-{slurm.PORT_MAX - 1}" in docs


# ----- a real one-node SLURM cluster -----


class Cluster:
    """The daemons of a one-node SLURM cluster on 127.0.0.1, and commands run against it."""

    def __init__(self, directory: str):
        self.dir = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.processes = []  # (name, Popen), stopped by PID at teardown
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k != "TF_CONFIG"}
        self.env.update(
            SLURM_CONF=self.conf,
            TF_CPP_MIN_LOG_LEVEL="3",
            PYTHONUNBUFFERED="1",
            PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        )

    def run(self, *command, timeout=30, check=True):
        return subprocess.run(
            command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def jobs(self) -> list:
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_gone(self, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while job in self.jobs():
            assert time.monotonic() < deadline, f"job {job} still in the queue after {timeout} s"
            time.sleep(0.5)

    def job_field(self, job: str, field: str) -> str:
        return re.search(rf"\b{field}=(\S+)", self.run("scontrol", "show", "job", job).stdout).group(1)


def _start_cluster(directory: str) -> Cluster:
    missing = [name for name in (*DAEMONS, *COMMANDS) if not shutil.which(name)]
    if missing:
        pytest.fail(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    cluster = Cluster(directory)
    munge_dir = os.path.join(directory, "munge")  # munged wants its own directory, others only traversing
    os.makedirs(munge_dir, mode=0o755)
    os.chmod(directory, 0o755)
    as_munge = os.geteuid() == 0 and _user_exists("munge")
    key = os.path.join(munge_dir, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    if as_munge:
        for path in (munge_dir, key):
            shutil.chown(path, "munge", "munge")
    socket_path = os.path.join(munge_dir, "munge.socket")
    ctld_port, slurmd_port = free_ports(2)
    user = _user_name()
    controller = socket.gethostname().split(".")[0]  # slurmctld serves only its own host name
    settings = {
        "ClusterName": "ctltest",
        "SlurmctldHost": f"{controller}(127.0.0.1)",
        "SlurmctldPort": ctld_port,
        "SlurmdPort": slurmd_port,
        "SlurmUser": user,
        "SlurmdUser": user,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        "AuthInfo": f"socket={socket_path},cred_expire=10",  # a requeued job waits out the credential
        "StateSaveLocation": os.path.join(directory, "state"),
        "SlurmdSpoolDir": os.path.join(directory, "spool"),
        "SlurmctldPidFile": os.path.join(directory, "slurmctld.pid"),
        "SlurmdPidFile": os.path.join(directory, "slurmd.pid"),
        "SlurmctldLogFile": os.path.join(directory, "slurmctld.log"),
        "SlurmdLogFile": os.path.join(directory, "slurmd.log"),
        "ProctrackType": "proctrack/linuxproc",  # no cgroups or systemd needed
        "TaskPlugin": "task/none",
        "CommunicationParameters": "NoInAddrAny,NoCtldInAddrAny",
        "SlurmdParameters": "config_overrides",  # the node's CPUs as written here, whatever the host has
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "MpiDefault": "none",
        "MailProg": "/bin/true",
        "ReturnToService": 2,
        "KillWait": 60,  # scancel's SIGKILL comes only after the tasks had time to save
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "FirstJobId": random.randint(1000, 900000),  # another cluster on this host gets other ports
    }
    lines = [f"{k}={v}" for k, v in settings.items()]
    lines += [
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={max(2, os.cpu_count() or 2)} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2",
    ]
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(directory, sub))
    with open(cluster.conf, "w") as f:
        f.write("\n".join(lines) + "\n")
    munged = [
        "munged",
        "--foreground",
        f"--socket={socket_path}",
        f"--key-file={key}",
        f"--pid-file={os.path.join(munge_dir, 'munged.pid')}",
        f"--log-file={os.path.join(munge_dir, 'munged.log')}",
        f"--seed-file={os.path.join(munge_dir, 'munged.seed')}",
    ]
    _daemon(cluster, "munged", munged, user="munge" if as_munge else None)
    _wait(lambda: os.path.exists(socket_path), 15, cluster, "munged's socket")
    _daemon(cluster, "slurmctld", ["slurmctld", "-D", "-f", cluster.conf])
    _daemon(cluster, "slurmd", ["slurmd", "-D", "-f", cluster.conf, "-N", "localhost"])
    _wait(
        lambda: cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle",
        30,
        cluster,
        "an idle node",
    )
    return cluster


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _daemon(cluster: Cluster, name: str, command: list, user=None) -> None:
    log = open(os.path.join(cluster.dir, f"{name}.out"), "w")
    process = subprocess.Popen(command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, user=user, group=user)
    cluster.processes.append((name, process))


def _wait(ready, timeout: float, cluster: Cluster, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for name, process in cluster.processes:
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}: {_tail(cluster, name)}")
        if time.monotonic() > deadline:
            logs = " | ".join(f"{name}: {_tail(cluster, name)}" for name, _ in cluster.processes)
            pytest.fail(f"no {what} after {timeout} s: {logs}")
        time.sleep(0.2)


def _tail(cluster: Cluster, name: str) -> str:
    with open(os.path.join(cluster.dir, f"{name}.out")) as f:
        return " / ".join(f.read().splitlines()[-5:])


def _stop_cluster(cluster: Cluster) -> None:
    """Cancels every job (its tasks end under slurmd's eye), then stops each daemon by its PID."""
    try:
        for job in cluster.jobs():
            cluster.run("scancel", job, check=False)
        deadline = time.monotonic() + 90
        while cluster.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
    except (subprocess.SubprocessError, OSError):
        pass
    for _, process in reversed(cluster.processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture(scope="module")
def slurm_cluster():
    directory = tempfile.mkdtemp(prefix="ctl-slurm-", dir="/tmp")  # munged (another user) must traverse it
    cluster = None
    try:
        cluster = _start_cluster(directory)
        yield cluster
    finally:
        if cluster is not None:
            _stop_cluster(cluster)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def undisturbed(slurm_cluster, tmp_path_factory):
    """`srun -n2` with no TF_CONFIG, left alone: (its output, its exported weights by name)."""
    model_dir = tmp_path_factory.mktemp("undisturbed")
    result = slurm_cluster.run(
        "srun",
        "-n2",
        "--label",
        sys.executable,
        "run.py",
        "--strategy=multi_worker_mirrored",
        *FLAGS,
        f"--model_dir={model_dir}",
        timeout=240,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output, exported_by_name(model_dir)


@pytest.mark.cluster
def test_srun_with_two_tasks_trains_two_workers_like_one_replica(undisturbed, tmp_path):
    output, weights = undisturbed
    assert "0: cluster      task worker:0 (chief) of 2 workers [worker:0=localhost:" in output, output[-4000:]
    assert "1: agreement    all 2 workers run the same flags" in output
    assert "0: global batch 64 = 2 replicas x 32" in output
    flags = dict(f[2:].split("=", 1) for f in FLAGS if "=" in f)
    one_replica = trained_by_name(
        tmp_path / "one",
        **{k: (int(v) if v.isdigit() else v) for k, v in flags.items() if k not in ("collective_timeout",)},
    )
    assert weights.keys() == one_replica.keys()
    for name in weights:
        np.testing.assert_allclose(weights[name], one_replica[name], rtol=0, atol=1e-6, err_msg=name)


def _submit(cluster: Cluster, model_dir, output: str) -> str:
    return cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=2",
        f"--output={output}",
        f"--chdir={REPO}",
        SBATCH,
        *FLAGS,
        f"--model_dir={model_dir}",
    ).stdout.strip()


def _read(path) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _wait_for(predicate, timeout: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s: {_read(log)[-4000:]}"
        time.sleep(0.2)


def _task_exit_codes(output: str) -> dict:
    """{task: code} from srun's `srun: error: <node>: task(s) 0-1: Exited with exit code N` lines."""
    codes = {}
    for tasks, code in re.findall(r"srun: error: \S+: tasks? ([\d,-]+): Exited with exit code (\d+)", output):
        for piece in tasks.split(","):
            low, _, high = piece.partition("-")
            codes.update({t: int(code) for t in range(int(low), int(high or low) + 1)})
    return codes


def _preempted_steps(output: str) -> set:
    return {int(s) for s in re.findall(r"^[01]: preempted: SIGTERM at step (\d+):", output, re.M)}


@pytest.mark.cluster
def test_scancel_stops_both_tasks_with_138_and_the_requeued_job_resumes_exactly(slurm_cluster, undisturbed, tmp_path):
    model_dir = tmp_path / "run"
    # 1. scancel: both tasks finish their loop, the chief saves, both exit 138; nothing requeues it.
    first_log = tmp_path / "first.out"
    job = _submit(slurm_cluster, model_dir, str(first_log))
    _wait_for(lambda: (model_dir / "checkpoints" / "checkpoint").exists(), 120, "first checkpoint", first_log)
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_gone(job, 90)
    first = _read(first_log)
    assert _task_exit_codes(first) == {0: exit_codes.PREEMPTED.code, 1: exit_codes.PREEMPTED.code}, first[-4000:]
    (stopped,) = _preempted_steps(first)  # both tasks stopped at one step
    assert int(checkpoint_state(model_dir)["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == stopped
    assert "requeueing" not in first and slurm_cluster.job_field(job, "JobState") == "CANCELLED"
    # 2. a new job resumes; SIGTERM to its tasks (what --signal=TERM@lead sends before the time
    # limit) ends it with 138, the script requeues it, and the requeued job resumes and finishes.
    second_log = tmp_path / "second.out"
    job = _submit(slurm_cluster, model_dir, str(second_log))
    resumed = f"(resuming at step {stopped})"
    _wait_for(
        lambda: _read(second_log).count(resumed) == 2 and "\n0: epoch" in _read(second_log),
        120,
        "resumed training",
        second_log,
    )
    slurm_cluster.run("scancel", "--signal=TERM", job)
    slurm_cluster.wait_gone(job, 150)
    second = _read(second_log)
    assert f"ctl-train: exit 138 (retryable): requeueing job {job}" in second, second[-4000:]
    (requeued_at,) = _preempted_steps(second)
    assert stopped < requeued_at < 24
    assert second.count(f"(resuming at step {requeued_at})") == 2, second[-4000:]
    assert "0: done   test loss" in second
    assert slurm_cluster.job_field(job, "JobState") == "COMPLETED" and slurm_cluster.job_field(job, "Restarts") == "1"
    resumed_weights, straight = exported_by_name(model_dir), undisturbed[1]
    assert resumed_weights.keys() == straight.keys()
    assert all(np.array_equal(resumed_weights[n], straight[n]) for n in straight)  # bitwise


@pytest.mark.cluster
def test_scancel_during_start_up_ends_both_tasks_with_154_none_by_the_default_action(slurm_cluster, tmp_path):
    """Both tasks past TensorFlow's rendezvous, building their model, nothing saved yet: scancel's
    SIGTERM ends each with 154 (it killed one by the default action, 143, and the other exited 150)."""
    log = tmp_path / "start.out"
    flags = [f for f in FLAGS if not f.startswith("--task=")] + [f"--task={TASKS_STARTUP}:SlowBuildTask"]
    job = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=2",
        f"--output={log}",
        f"--chdir={REPO}",
        SBATCH,
        *flags,
        f"--model_dir={tmp_path / 'run'}",
    ).stdout.strip()
    _wait_for(lambda: _read(log).count(BUILDING) == 2, 150, "both tasks building their model", log)
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_gone(job, 90)
    output = _read(log)
    codes = exit_codes.STOPPED_AT_STARTUP.code
    assert _task_exit_codes(output) == {0: codes, 1: codes}, output[-4000:]
    assert output.count("stopped: SIGTERM during start-up, before training had state to save") == 2, output[-4000:]
    assert "Traceback" not in output
