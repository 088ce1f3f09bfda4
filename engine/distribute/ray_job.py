"""Ray Train: `python -m engine.distribute.ray_job --ray_workers=N -- <run.py flags>` runs the
engine's multi_worker_mirrored job on N workers of a Ray cluster (docs/strategies.md#ray).

Ray Train's TensorflowTrainer starts the workers and sets each one's TF_CONFIG; each worker runs
run.py as a child process with that TF_CONFIG, so the engine keeps its own validation, agreement,
watchdog and exit codes. The child's environment loses TF_USE_LEGACY_KERAS, which Ray's TensorFlow
backend sets and which makes Keras 3 fail at import. A child dies with its Ray worker (Linux's
parent-death signal), so no engine process outlives a group Ray has torn down.

The first failure of a group decides for all of it (as in the local launcher): the other workers'
children get SIGTERM (they save and exit). A retryable code (engine/exit_codes.py: >= 128, or
killed by a signal) raises, and Ray's failure policy (`FailureConfig(max_failures=--max_restarts)`)
starts a new group, which resumes from the last checkpoint in the shared --model_dir; its children
get the restart count (launch.RESTARTS_ENV), logged by the chief as the scalar `restarts`. A
permanent code returns normally, so Ray retries nothing, and the job ends with that code. A small
actor holds what the groups share: which group is which restart, and each group's first failure.

Ray is imported only here (not by run.py or the rest of the engine); no TensorFlow import here,
though Ray's TensorflowTrainer imports TensorFlow in this process and in each Ray worker.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

from engine import exit_codes
from engine.distribute.launch import GRACE_SECONDS, RESTARTS_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds engine/ and run.py
RUN_PY = os.path.join(ROOT, "run.py")
POLL_SECONDS = 1.0  # how often a worker asks whether another worker of its group failed


class _Outcome:
    """The Ray actor the worker groups of one job share (no TensorFlow, no engine state)."""

    def __init__(self):
        self.groups = []  # placement group ids, in the order the groups started: index = restarts
        self.first = {}  # restarts -> the first non-zero exit code of that group

    def join(self, group) -> int:
        if group not in self.groups:
            self.groups.append(group)
        return self.groups.index(group)

    def failed(self, restarts: int, code: int) -> int:
        self.first.setdefault(restarts, code)
        return self.first[restarts]

    def first_failure(self, restarts: int):
        return self.first.get(restarts)

    def last_failure(self):
        return self.first[max(self.first)] if self.first else None


class RetryableExit(RuntimeError):
    """A worker group's first failure was one a restart may cure: Ray's failure policy decides."""


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when its Ray worker dies (PR_SET_PDEATHSIG, Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _worker(config: dict):
    """One Ray worker: run.py with Ray's TF_CONFIG, waited for; see the module docstring."""
    import ray
    import ray.train

    outcome = config["outcome"]
    rank = ray.train.get_context().get_world_rank()
    restarts = ray.get(outcome.join.remote(ray.get_runtime_context().get_placement_group_id()))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", RESTARTS_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    if restarts:
        env[RESTARTS_ENV] = str(restarts)
    print(f"ray_job: worker {rank} runs run.py (restart {restarts})", flush=True)
    child = subprocess.Popen([sys.executable, config["script"], *config["args"]], env=env, preexec_fn=_die_with_parent)
    code = _wait(child, outcome, restarts)
    first = ray.get(outcome.failed.remote(restarts, code)) if code else ray.get(outcome.first_failure.remote(restarts))
    if first and exit_codes.retryable(first):
        raise RetryableExit(
            f"worker {rank}: run.py exited {code}; the group's first failure was exit {first} "
            f"({exit_codes.describe(first)})"
        )
    return first or 0


def _wait(child, outcome, restarts: int) -> int:
    """The child's exit code (killed by signal N: 128 + N); SIGTERM to it once another worker of
    its group failed, SIGKILL after GRACE_SECONDS."""
    import ray

    stopping_since = None
    while True:
        try:
            code = child.wait(timeout=POLL_SECONDS)
            return 128 - code if code < 0 else code
        except subprocess.TimeoutExpired:
            pass
        if stopping_since is None:
            if ray.get(outcome.first_failure.remote(restarts)) is not None:
                child.send_signal(signal.SIGTERM)
                stopping_since = 0.0
        else:
            stopping_since += POLL_SECONDS
            if stopping_since >= GRACE_SECONDS:
                child.kill()


def _flag_value(flags: list, name: str):
    """The value of --name=value (or --name value) among run.py's flags, else None."""
    for i, flag in enumerate(flags):
        if flag.startswith(f"--{name}="):
            return flag.split("=", 1)[1]
        if flag == f"--{name}" and i + 1 < len(flags):
            return flags[i + 1]
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.distribute.ray_job",
        usage="python -m engine.distribute.ray_job --ray_workers=N [options] -- <run.py flags>",
        description="Runs run.py --strategy=multi_worker_mirrored on N Ray Train workers (docs/strategies.md#ray).",
    )
    parser.add_argument("--ray_workers", type=int, required=True, help="Ray workers, one engine worker each.")
    parser.add_argument(
        "--ray_address",
        default=None,
        help="The Ray cluster (host:port of its head); default: RAY_ADDRESS, else a cluster started on this "
        "machine, else a new local one for this job.",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="New worker groups after a retryable failure (Ray's FailureConfig.max_failures); permanent "
        f"failures ({', '.join(map(str, exit_codes.PERMANENT))}) are never retried.",
    )
    parser.add_argument(
        "--use_gpu", action="store_true", help="One GPU per Ray worker (Ray sets CUDA_VISIBLE_DEVICES)."
    )
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = _parser().parse_args(own)
    strategy, model_dir = _flag_value(flags, "strategy"), _flag_value(flags, "model_dir")
    error = None
    if args.ray_workers < 1 or args.max_restarts < 0:
        error = f"--ray_workers={args.ray_workers} and --max_restarts={args.max_restarts}: need >= 1 and >= 0"
    elif strategy not in (None, "multi_worker_mirrored"):
        error = f"--strategy={strategy}: the Ray workers form one multi_worker_mirrored cluster; leave --strategy out"
    elif not model_dir:
        error = "run.py's flags (after --) need --model_dir=DIR, on storage every Ray node sees"
    if error:
        print(f"error: {error}", file=sys.stderr)
        return exit_codes.BAD_INPUT.code
    if strategy is None:
        flags = ["--strategy=multi_worker_mirrored", *flags]
    return _run(args, flags, os.path.abspath(model_dir))


def _run(args, flags: list, model_dir: str) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError

    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # this engine, on every worker
    ray.init(address=args.ray_address, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        outcome = ray.remote(num_cpus=0)(_Outcome).remote()
        trainer = TensorflowTrainer(
            _worker,
            train_loop_config={"outcome": outcome, "script": RUN_PY, "args": flags},
            scaling_config=ScalingConfig(num_workers=args.ray_workers, use_gpu=args.use_gpu),
            run_config=RunConfig(
                storage_path=os.path.join(model_dir, "ray"),
                failure_config=FailureConfig(max_failures=args.max_restarts),
            ),
        )
        try:
            code = trainer.fit().return_value or 0
        except TrainingFailedError as err:
            code = ray.get(outcome.last_failure.remote())
            if code is None:  # Ray's own failure (a worker actor lost), not the engine's
                print(f"ray_job: {type(err).__name__}: {err}", file=sys.stderr)
                code = exit_codes.PEER_LOST.code
    finally:
        ray.shutdown()
    print(f"ray_job: exit {code}" + (f" ({exit_codes.describe(code)})" if code else ""), file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
