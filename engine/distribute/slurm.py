"""A SLURM job step as a cluster: TF_CONFIG built from SLURM's variables, before TensorFlow loads.

Under `srun` with several tasks and no TF_CONFIG, `--strategy=multi_worker_mirrored` makes one
cluster of the step's tasks: worker i is the task with SLURM_PROCID i (worker 0 is the chief), on
its node from the step's node list (SLURM_STEP_NODELIST, hostlist syntax `node[01-03,07],gpu5`)
and tasks per node (SLURM_STEP_TASKS_PER_NODE, `2(x3),1`), placed as srun's distribution places
them (block, cyclic or plane; each task checks its own place against SLURM_NODEID and
SLURM_LOCALID). run.py then sets TF_CONFIG, so validation, flag agreement, the watchdog and the stall
detection are the same as for a hand-written TF_CONFIG. TensorFlow's SlurmClusterResolver is not
used: it runs nvidia-smi and fails on a CPU-only node. CUDA_VISIBLE_DEVICES stays as SLURM set it.

Ports: `srun --resv-ports` (SLURM_STEP_RESV_PORTS, where the cluster's MpiParams reserves ports)
gives each task of a node one of the step's reserved ports. Otherwise each job step gets its own
block of PORTS_PER_STEP ports in [PORT_MIN, PORT_MAX), from SLURM_JOB_ID and SLURM_STEP_ID, so
concurrent jobs on one node do not collide (below Linux's ephemeral range, which outgoing
connections use); a requeued job keeps its id and so its ports.

With any other strategy, a step of several tasks is refused: every task would train alone, all
into the same --model_dir. A step of one task is left alone (e.g. the local launcher inside it).
No TensorFlow import here.
"""

from __future__ import annotations

import json
import re
import socket

from engine.errors import UserError

PORT_MIN = 20000  # the derived ports: [PORT_MIN, PORT_MAX), a block of PORTS_PER_STEP per job step
PORT_MAX = 32000  # Linux's ephemeral ports start at 32768
PORTS_PER_STEP = 32  # so at most this many tasks of one step share a node
STEPS_PER_JOB = 4  # concurrent steps of one job with their own ports
_BLOCKS = (PORT_MAX - PORT_MIN) // PORTS_PER_STEP


def expand_hostlist(text: str) -> list:
    """`node[01-03,07],gpu5` -> ['node01', 'node02', 'node03', 'node07', 'gpu5'] (SLURM's hostlist
    syntax: comma-separated names, each with bracketed ranges that keep their zero padding)."""
    hosts = []
    for name in _split_outside_brackets(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", name)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                choices = _expand_range(part[1:-1], text)
            elif "[" in part or "]" in part:
                raise UserError(f"SLURM node list {text!r} has an unbalanced bracket")
            else:
                choices = [part]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts += expanded
    if not hosts or not all(hosts):
        raise UserError(f"SLURM node list {text!r} names no hosts")
    return hosts


def _split_outside_brackets(text: str) -> list:
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if depth < 0 or depth > 1:
            raise UserError(f"SLURM node list {text!r} has an unbalanced bracket")
        if char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise UserError(f"SLURM node list {text!r} has an unbalanced bracket")
    names.append(text[start:])
    return [n for n in names if n]


def _expand_range(inside: str, text: str) -> list:
    out = []
    for piece in inside.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not match:
            raise UserError(f"SLURM node list {text!r} has a bad range [{inside}]")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise UserError(f"SLURM node list {text!r} has a decreasing range {piece}")
        width = len(low)
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def expand_tasks_per_node(text: str) -> list:
    """`2(x3),1` -> [2, 2, 2, 1] (SLURM's compressed count list)."""
    counts = []
    for piece in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not match:
            raise UserError(f"SLURM tasks per node {text!r} is not like '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def place_tasks(counts: list, distribution: str = "", plane_size: int = 0) -> list:
    """(node index, local index) of each task rank, as srun places them: block fills each node in
    turn, cyclic deals one task to each node with room in turn, plane deals plane_size at a time."""
    kind = (distribution or "block").split(":")[0].split(",")[0]
    if kind in ("block", "*"):
        chunk = max(counts, default=0)
    elif kind == "cyclic":
        chunk = 1
    elif kind == "plane" and plane_size > 0:
        chunk = plane_size
    else:
        raise UserError(
            f"SLURM_DISTRIBUTION={distribution!r}: the engine builds the cluster for block, cyclic and "
            "plane distributions only; use one of them or set TF_CONFIG yourself"
        )
    left, places = list(counts), []
    while any(left):
        for node, room in enumerate(left):
            for _ in range(min(chunk, room)):
                places.append((node, counts[node] - left[node]))
                left[node] -= 1
    return places


def step_ports(job_id: int, step_id: int) -> list:
    """This job step's derived ports (a task uses the one of its local index on its node)."""
    block = (job_id * STEPS_PER_JOB + step_id % STEPS_PER_JOB) % _BLOCKS
    start = PORT_MIN + block * PORTS_PER_STEP
    return list(range(start, start + PORTS_PER_STEP))


def _reserved_ports(text: str) -> list:
    """SLURM_STEP_RESV_PORTS, e.g. `12000-12003` or `12000,12005-12006`."""
    ports = []
    for piece in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not match:
            raise UserError(f"SLURM_STEP_RESV_PORTS={text!r} is not a port list like 12000-12003")
        ports += range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1)
    return ports


def num_tasks(env) -> int:
    """The tasks of this srun step, 0 outside one (the batch shell has SLURM_NTASKS but no step)."""
    value = env.get("SLURM_STEP_NUM_TASKS")
    return int(value) if value and value.isdigit() else 0


def tf_config(env) -> dict:
    """The TF_CONFIG dict of this task of a SLURM step of several tasks."""
    try:
        rank, tasks = int(env["SLURM_PROCID"]), num_tasks(env)
        job_id, step_id = int(env["SLURM_JOB_ID"]), int(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or 0)
    except (KeyError, ValueError) as err:
        raise UserError(f"srun step without a usable SLURM variable ({err}); set TF_CONFIG yourself") from None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    hosts, counts = expand_hostlist(nodelist), expand_tasks_per_node(per_node)
    if len(hosts) != len(counts) or sum(counts) != tasks:
        raise UserError(
            f"SLURM step of {tasks} tasks: node list {nodelist!r} ({len(hosts)} nodes) and tasks per node "
            f"{per_node!r} ({sum(counts)} tasks on {len(counts)} nodes) disagree; set TF_CONFIG yourself"
        )
    if not 0 <= rank < tasks:
        raise UserError(f"SLURM_PROCID={rank} is not a task of this step of {tasks}; set TF_CONFIG yourself")
    places = place_tasks(counts, env.get("SLURM_DISTRIBUTION", ""), int(env.get("SLURM_DIST_PLANESIZE") or 0))
    mine = (int(env.get("SLURM_NODEID", places[rank][0])), int(env.get("SLURM_LOCALID", places[rank][1])))
    if places[rank] != mine:
        raise UserError(
            f"SLURM task {rank} runs as local task {mine[1]} of node {mine[0]}, not where the distribution "
            f"{env.get('SLURM_DISTRIBUTION') or 'block'} puts it (local task {places[rank][1]} of node "
            f"{places[rank][0]}); set TF_CONFIG yourself"
        )
    reserved = env.get("SLURM_STEP_RESV_PORTS")
    ports = _reserved_ports(reserved) if reserved else step_ports(job_id, step_id)
    if max(counts) > len(ports):
        source = f"SLURM_STEP_RESV_PORTS={reserved}" if reserved else "the engine's per-step port block"
        raise UserError(
            f"SLURM step puts {max(counts)} tasks on one node but {source} has {len(ports)} ports; "
            "use fewer tasks per node (each task uses every device SLURM gives it)"
        )
    workers = [f"{hosts[node]}:{ports[local]}" for node, local in places]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def configure(strategy: str, num_workers: int, env) -> str | None:
    """For run.py, before TensorFlow loads: the TF_CONFIG to set for this srun task (a JSON
    string), or None where SLURM has nothing to say. Raises UserError where a SLURM step and the
    flags do not fit together."""
    if env.get("TF_CONFIG"):
        return None
    tasks = num_tasks(env)
    multi_worker = strategy == "multi_worker_mirrored"
    if tasks == 0:  # not an srun step: the batch shell, or no SLURM at all
        job_tasks = env.get("SLURM_NTASKS", "")
        if multi_worker and not num_workers and job_tasks.isdigit() and int(job_tasks) > 1:
            raise UserError(
                f"this SLURM job has {job_tasks} tasks but this process is no task of an srun step: "
                "start the workers with `srun python run.py --strategy=multi_worker_mirrored ...`"
            )
        return None
    if tasks == 1:
        return None  # one task: nothing to share (the local launcher may run inside it)
    if not multi_worker:
        raise UserError(
            f"srun started {tasks} tasks of --strategy={strategy}: each would train alone into the same "
            "--model_dir; use --strategy=multi_worker_mirrored (one cluster of every task) or one task (srun -n1)"
        )
    if num_workers and num_workers != tasks:
        raise UserError(f"--num_workers={num_workers} but the srun step has {tasks} tasks")
    spec = tf_config(env)
    _check_port_free(spec["cluster"]["worker"][spec["task"]["index"]])
    return json.dumps(spec)


def _check_port_free(address: str) -> None:
    """This task's port must be free here: a listener on it would take the worker's place."""
    port = int(address.rsplit(":", 1)[1])
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no listener
    try:
        probe.bind(("", port))
    except OSError as err:
        raise UserError(
            f"SLURM task's port {port} (for {address}) is taken on this node ({err.strerror}); "
            "start the step with `srun --resv-ports` or set TF_CONFIG yourself"
        ) from None
    finally:
        probe.close()
