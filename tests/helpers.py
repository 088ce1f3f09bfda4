"""Helpers the tests share: the test Tasks' files (TASKS_*), the small run (small_config in-process,
small_flags for run.py), running run.py in a fresh process (run_cli to its end; start_cli and
start_workers in the background, the latter a cluster of workers on 127.0.0.1) or run.py's main in
this one (run_in_process), comparing runs
(max_difference), reading what a run wrote (exported weights, checkpoints, TensorBoard events).
Test modules import from here (or get fixtures from conftest.py); no test module imports another
test module (tests/test_import_graph.py). conftest.py has already split the CPU into 2 logical
devices when this module is imported."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from engine.config import Config
from engine.data import tfrecord
from engine.distribute.launch import worker_tf_configs
from engine.distribute.strategy import build_strategy
from engine.loop import make_eval_loop
from tasks_data import IdCountingTask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Tasks the tests load with --task=PATH:Name (or import), one file per concern; the engine
# loads a Task file by its path, so these files import nothing from one another.
TASKS_ACTIONS = os.path.join(REPO, "tests", "tasks_actions.py")  # a Task with its own action
TASKS_COLLECT = os.path.join(REPO, "tests", "tasks_collect.py")  # whole-eval-set metrics (self.collect)
TASKS_DATA = os.path.join(REPO, "tests", "tasks_data.py")  # own pipelines, example counting, augmentation
TASKS_EQUIVALENCE = os.path.join(REPO, "tests", "tasks_equivalence.py")  # N replicas like one; scaling mistakes
TASKS_FAULTS = os.path.join(REPO, "tests", "tasks_faults.py")  # a worker fails, hangs, dies or slows down
TASKS_NONFINITE = os.path.join(REPO, "tests", "tasks_nonfinite.py")  # NaN/Inf on one replica at one step
TASKS_REFUSED = os.path.join(REPO, "tests", "tasks_refused.py")  # user-code mistakes refused or ended in one line
TASKS_STARTUP = os.path.join(REPO, "tests", "tasks_startup.py")  # a start-up slow enough to signal
TASKS_STATE = os.path.join(REPO, "tests", "tasks_state.py")  # extra models, optimizers, host state, collectives
TASKS_EAGER = os.path.join(REPO, "tests", "tasks_eager.py")  # steps that print and read .numpy() (--run_eagerly)
NO_DROPOUT = f"{TASKS_EQUIVALENCE}:CnnBnNoDropoutTask"  # cnn_bn, dropout 0, BN momentum 0.5
# train(config, **QUIET): no progress lines on the console
QUIET = dict(out=open(os.devnull, "w"))


# A fast run: synthetic data (said explicitly, so that no test depends on Config's default dataset),
# few steps, a fixed seed. small_config builds it in-process, small_flags as run.py flags.
SMALL_RUN = dict(
    dataset="synthetic",
    synthetic_train_examples=1024,
    synthetic_test_examples=300,
    global_batch=64,
    train_steps=6,
    steps_per_loop=3,
    seed=7,
)


def small_config(model_dir, **overrides) -> Config:
    """SMALL_RUN as a Config writing to model_dir, without an export unless overridden."""
    return Config(**{**SMALL_RUN, "model_dir": str(model_dir), "export": False, **overrides})


# A tiny mlp run on synthetic data as run.py flags (the CLI tests' base; each adds its own steps).
TINY_FLAGS = (
    "--dataset=synthetic",
    "--synthetic_train_examples=512",
    "--synthetic_test_examples=100",
    "--global_batch=64",
    "--steps_per_loop=2",
    "--seed=1",
    "--model=mlp",
)


def small_flags(**changes) -> list:
    """SMALL_RUN with `changes` (a value None drops that flag) as run.py flags, e.g.
    small_flags(model="mlp") is small_config(..., model="mlp")'s run; --model_dir and --[no]export
    are each test's to say."""
    return [f"--{name}={value}" for name, value in {**SMALL_RUN, **changes}.items() if value is not None]


def exported_weights(model_dir) -> list:
    model = keras.models.load_model(os.path.join(str(model_dir), "export", "model.keras"))
    return [w.numpy() if hasattr(w, "numpy") else np.asarray(w) for w in model.weights]


def exported_by_name(model_dir) -> dict:
    """{weight path: array} of model_dir/export/model.keras."""
    model = keras.models.load_model(os.path.join(str(model_dir), "export", "model.keras"))
    return {w.path: np.asarray(w.numpy()) for w in model.weights}


def trained_by_name(model_dir, **overrides) -> dict:
    """Trains small_config(model_dir, export=True, **overrides) in this process; its exported weights
    by path (for comparing runs, e.g. 2 replicas against 1). Keras' layer-name counters are reset
    first, so the names match a run in a fresh process (run.py, srun) whatever this process built."""
    from engine.controller.trainer import train

    keras.utils.clear_session()
    train(small_config(model_dir, **{**overrides, "export": True}), out=open(os.devnull, "w"))
    return exported_by_name(model_dir)


def max_difference(a, b, moving_only=False) -> float:
    """The largest absolute difference (in float64) between two runs' weights: two lists of arrays
    in the same order (exported_weights), or two {name: array} with the same names (exported_by_name,
    trained_by_name, checkpoint_state). Only floating-point arrays count (a checkpoint's step
    counters are no weights); moving_only: batch norm's moving statistics only (names with "moving_")."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        pairs = [(a[n], b[n]) for n in a if "moving_" in n or not moving_only]
    else:
        assert not moving_only and len(a) == len(b)
        pairs = list(zip(a, b))
    pairs = [(x, y) for x, y in pairs if np.asarray(x).dtype.kind == "f"]
    assert pairs
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - y))) for x, y in pairs)


def tensorboard_run(logdir):
    """An EventAccumulator with every event of a TensorBoard log directory loaded."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_scalars(logdir) -> dict:
    """{tag: [(step, value), ...]} of the scalars in a TensorBoard log directory."""
    accumulator = tensorboard_run(logdir)
    # tf.summary.* in TF 2 writes tensor events; EventAccumulator lists them under "tensors".
    return {
        tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]
        for tag in accumulator.Tags()["tensors"]
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
    }


def _cli(args, env):
    """The command line and environment of `python run.py args...`."""
    return [sys.executable, os.path.join(REPO, "run.py"), *args], {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **(env or {}),
    }


def run_cli(*args, timeout=240, env=None):
    """Runs `python run.py args...` in a fresh process; returns the CompletedProcess."""
    command, full_env = _cli(args, env)
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_in_process(*args):
    """`python run.py args...` without a new process: absl parses `args` into its global FLAGS (as
    app.run does, flag errors ending in SystemExit(1)), then run.main runs, here. Returns a
    CompletedProcess like run_cli's: the exit code, and what was written to sys.stdout and sys.stderr
    meanwhile (Python logging handlers that write to a console stream included; not what C++ writes
    to the file descriptors). Every flag is reset before and after (FLAGS.unparse_flags), and absl's
    verbosity restored, so nothing of one call reaches the next. For cases that need no fresh process:
    not for another --cpu_replicas than conftest.py's 2, environment read at import, or the launcher."""
    import contextlib
    import io

    from absl import app
    from absl import flags as absl_flags
    from absl import logging as absl_logging

    import run
    from engine import startup_signals

    stdout, stderr = io.StringIO(), io.StringIO()
    verbosity = absl_logging.get_verbosity()
    handlers = _console_handlers()
    streams = [handler.stream for handler in handlers]
    absl_flags.FLAGS.unparse_flags()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            for handler in handlers:
                handler.stream = stderr
            try:
                code = run.main(app.parse_flags_with_usage([os.path.join(REPO, "run.py"), *args]))
            except SystemExit as exit_:
                code = 0 if exit_.code is None else exit_.code
    finally:
        for handler, stream in zip(handlers, streams):
            handler.stream = stream
        absl_flags.FLAGS.unparse_flags()
        absl_logging.set_verbosity(verbosity)
        startup_signals.reset()  # main() moved the start-up signal state (run.py installs no handler on import)
    return subprocess.CompletedProcess(["run.py", *args], code, stdout.getvalue(), stderr.getvalue())


def _console_handlers() -> list:
    """The logging StreamHandlers (absl's and TensorFlow's among them) that write to this process's
    stdout or stderr, which run_in_process points at what it captures."""
    import logging

    from absl import logging as absl_logging

    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    handlers = {id(h): h for logger in loggers for h in logger.handlers}
    handlers[id(absl_logging.get_absl_handler().python_handler)] = absl_logging.get_absl_handler().python_handler
    console = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return [
        h
        for h in handlers.values()
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h.stream in console
    ]


class Background:
    """`python run.py args...` running in the background (start_cli, start_workers). Reader threads
    collect its output lines as they arrive, so it never blocks on a full pipe and a test can act at
    a moment of its output (wait_for_line) or at one of its own choosing (send_signal, kill);
    wait() bounds it. With merge_stderr (the default) stderr goes into stdout, in the order written.
    A `with` block kills it at its end unless it has ended."""

    def __init__(self, args, env=None, merge_stderr=True):
        command, full_env = _cli(args, env)
        self.started = time.monotonic()
        self.exited = None  # seconds since start, once wait() or kill() has seen it end
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines = []  # (seconds since start, "out" or "err", line), in order of arrival
        self._arrived = threading.Condition()
        streams = [(self.process.stdout, "out")] + ([] if merge_stderr else [(self.process.stderr, "err")])
        self._readers = [threading.Thread(target=self._read, args=stream, daemon=True) for stream in streams]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name):
        for line in stream:
            with self._arrived:
                self.lines.append((time.monotonic() - self.started, name, line))
                self._arrived.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self):
        return self.process.returncode

    def poll(self):
        return self.process.poll()

    def send_signal(self, signum):
        self.process.send_signal(signum)

    def _text(self, streams) -> str:
        with self._arrived:
            return "".join(line for _, name, line in self.lines if name in streams)

    @property
    def output(self) -> str:
        """All it has written so far, stdout and stderr."""
        return self._text(("out", "err"))

    @property
    def stdout(self) -> str:
        return self._text(("out",))

    @property
    def stderr(self) -> str:
        return self._text(("err",))

    def wait_for_line(self, pattern, timeout, running=()) -> str:
        """Its first line that matches `pattern` (re.search), waited for up to `timeout` s; the test
        fails if the line does not come, or if this process or one of `running` ends first."""
        deadline, seen = time.monotonic() + timeout, 0
        with self._arrived:
            while True:
                for _, _, line in self.lines[seen:]:
                    if re.search(pattern, line):
                        return line
                seen = len(self.lines)
                drained = self.poll() is not None and not any(reader.is_alive() for reader in self._readers)
                left = deadline - time.monotonic()
                if drained or left <= 0 or any(other.poll() is not None for other in running):
                    break
                self._arrived.wait(timeout=min(0.1, left))
        raise AssertionError(
            f"no line matching {pattern!r} within {timeout} s (exit code {self.poll()}, others' "
            f"{[other.poll() for other in running]}):\n{self.output[-3000:]}"
        )

    def wait(self, timeout) -> int:
        """Its exit code, once it ends within `timeout` s; else it is killed and the test fails."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-3000:]}") from None
        self._ended()
        return self.process.returncode

    def kill(self):
        """Ends it now (SIGKILL, which ends a stopped process too) unless it has ended."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._ended()

    def _ended(self):
        if self.exited is None:
            self.exited = time.monotonic() - self.started
        for reader in self._readers:
            reader.join(timeout=10)  # the pipes close when the process ends
        if not any(reader.is_alive() for reader in self._readers):
            for stream in (self.process.stdout, self.process.stderr):
                if stream:
                    stream.close()


def start_cli(*args, env=None, merge_stderr=True) -> Background:
    """Starts `python run.py args...` in a fresh process in the background (run_cli runs one to its end)."""
    return Background(args, env, merge_stderr)


class Cluster:
    """The processes start_workers started: cluster[i] is worker i's Background (the evaluator's
    last), with the TF_CONFIG it was given in tf_configs[i]. A `with` block kills what still runs
    at its end."""

    def __init__(self, processes: list, tf_configs: list):
        self.processes, self.tf_configs = processes, tf_configs

    def __getitem__(self, index) -> Background:
        return self.processes[index]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()

    @property
    def codes(self) -> list:
        return [process.returncode for process in self.processes]

    @property
    def outputs(self) -> list:
        return [process.output for process in self.processes]

    def wait(self, timeout) -> list:
        """Every exit code, once all have ended within `timeout` s (one deadline for all); else
        every process is killed and the test fails."""
        deadline = time.monotonic() + timeout
        try:
            for process in self.processes:
                process.wait(max(0.0, deadline - time.monotonic()))
        except AssertionError:
            self.kill()
            tails = "\n".join(f"--- process {i} ---\n{output[-3000:]}" for i, output in enumerate(self.outputs))
            raise AssertionError(f"not every process ended within {timeout} s:\n{tails}") from None
        return self.codes

    def wait_for_line(self, index, pattern, timeout) -> str:
        """Process `index`'s first line that matches `pattern`; fails if any process ends first."""
        others = [process for i, process in enumerate(self.processes) if i != index]
        return self.processes[index].wait_for_line(pattern, timeout, running=others)

    def wait_until(self, condition, timeout) -> bool:
        """Polls condition() every 0.1 s until it holds, `timeout` s pass or a process ends; returns condition()."""
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            if any(process.poll() is not None for process in self.processes):
                break
            time.sleep(0.1)
        return condition()

    def kill(self):
        for process in self.processes:
            process.kill()


def start_workers(args, n=2, *, per_worker=None, env=None, evaluator=False) -> Cluster:
    """Starts `python run.py --strategy=multi_worker_mirrored args...` as `n` workers on free
    127.0.0.1 ports, and with `evaluator` a sidecar evaluator after them, each given its TF_CONFIG
    (and `env`); stderr goes into stdout. per_worker: more args for each process, a list each."""
    tf_configs = worker_tf_configs(n, evaluator=evaluator)
    extras = per_worker or [[] for _ in tf_configs]
    assert len(extras) == len(tf_configs), (len(extras), len(tf_configs))
    processes = []
    try:
        for tf_config, extra in zip(tf_configs, extras):
            command = ["--strategy=multi_worker_mirrored", *args, *extra]
            processes.append(Background(command, env={**(env or {}), "TF_CONFIG": tf_config}))
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return Cluster(processes, tf_configs)


@dataclasses.dataclass
class TimedRun:
    returncode: int
    lines: list  # (seconds since start, "out" or "err", line), in order of arrival
    exited: float  # seconds since start

    @property
    def output(self) -> str:
        return "".join(line for _, _, line in self.lines)

    @property
    def seconds_after_last_line(self) -> float:
        return self.exited - (self.lines[-1][0] if self.lines else 0.0)


def run_cli_timed(*args, timeout=240, env=None) -> TimedRun:
    """Like run_cli, but notes when each stdout/stderr line arrived and when the process ended,
    e.g. to see how long it took to exit after its last line."""
    with Background(args, env, merge_stderr=False) as process:
        process.wait(timeout)
    return TimedRun(process.returncode, list(process.lines), process.exited)


def explain(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"


def checkpoint_state(model_dir, prefixes=("model/", "optimizer/", "global_step/", "epoch/")) -> dict:
    """{name: value} of the latest checkpoint's variables under `prefixes` (default: the model, the
    optimizer and the counters; "task/" holds the Task's own state)."""
    latest = tf.train.latest_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    reader = tf.train.load_checkpoint(latest)
    return {
        name: reader.get_tensor(name) for name, _ in tf.train.list_variables(latest) if name.startswith(tuple(prefixes))
    }


def stream_eval_totals(source, replicas: int, batch: int, task_class=IdCountingTask):
    """(examples the engine counted, sum of their ids) of one distributed eval of a streamed source."""
    strategy = build_strategy("mirrored", replicas).strategy
    task = task_class(small_config("/unused"), spec=source.spec)
    result = make_eval_loop(strategy, task)(strategy.distribute_datasets_from_function(source.eval_dataset_fn(batch)))
    assert float(result["totals"]["mean_id"][1]) == float(result["examples"])  # the Task's count agrees
    return float(result["examples"]), float(result["totals"]["mean_id"][0])


def id_arrays(n, offset=0):
    """Examples that carry their own id: features (4,) float32 all equal to the id, label id % 10."""
    ids = np.arange(offset, offset + n)
    return np.repeat(ids[:, None], 4, axis=1).astype(np.float32), (ids % 10).astype(np.int64)


def id_shards(directory, n_train=200, n_test=1001, shards=4):
    x, y = id_arrays(n_train)
    xt, yt = id_arrays(n_test, offset=1000)
    tfrecord.write_shards(str(directory), "train", x, y, shards)
    tfrecord.write_shards(str(directory), "test", xt, yt, shards)
    return f"tfrecord:{directory}/train-*.tfrecord,{directory}/test-*.tfrecord"


def screenshots_script():
    """docs/screenshots.py as a module: starts tensorboard on 127.0.0.1 and drives headless Chromium."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("screenshots", os.path.join(REPO, "docs", "screenshots.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
