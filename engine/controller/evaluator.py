"""The evaluation job: --mode=eval (one checkpoint) and --mode=continuous_eval (each new
checkpoint of a run, once; what a TF_CONFIG task of type `evaluator` runs beside the workers).

It builds the model, optimizer and counters as training does (engine/controller/job.py and state.py, inside
strategy.scope() of whatever strategy THIS process has), restores a checkpoint read-only (it never
writes into the run's checkpoints/), evaluates the whole test split and writes the metrics to the
run's eval/ TensorBoard run at the checkpoint's step. Only checkpoints the manager's `checkpoint`
state file lists are read (a half-written one is not listed yet); one deleted before it could be
restored, or one that cannot be read back (damaged), is skipped with a one-line warning and left
where it is. Evaluated steps are recorded in model_dir/eval/evaluated.json,
so a restarted evaluator skips them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import tensorflow as tf

from engine.controller import job, run_record
from engine.controller.state import build_task_state
from engine.controller.evaluation import check_collect, evaluate_split, metric_names
from engine.controller.best import BestKeeper
from engine.controller.checkpoints import CheckpointDamaged, checkpoint_files
from engine.data import pipelines
from engine.distribute import strategy as strategy_lib
from engine.errors import UserError
from engine.loop import make_eval_loop
from engine.observe.summaries import SummaryWriter

POLL_SECONDS = 1.0
EVALUATED_FILE = "evaluated.json"
# Identity flags the evaluator may differ in: its global batch only splits the test set.
_NOT_COMPARED = ("global_batch",)


@dataclasses.dataclass
class EvalResult:
    model_dir: str
    evaluated: dict  # step -> {metric: value}, in the order evaluated by this process
    skipped: list  # checkpoint paths deleted before they could be restored


def evaluate(config, out=None) -> EvalResult:
    """Runs --mode=eval or --mode=continuous_eval as `config` says."""
    with job.context(config):  # --precision's dtype policy; bad input records -> one line
        return _Evaluator(config, out or sys.stdout).run()


def checkpoint_step(path: str) -> int | None:
    """The step of a checkpoint saved by the engine (ckpt-<step>)."""
    tail = os.path.basename(path).rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def listed_checkpoints(model_dir: str) -> list:
    """[(step, path)] of the complete checkpoints (those the `checkpoint` state file lists), by step."""
    try:
        state = tf.train.get_checkpoint_state(os.path.join(model_dir, "checkpoints"))
    except ValueError:  # an empty state file (garbage gives None): nothing is listed
        state = None
    paths = list(state.all_model_checkpoint_paths) if state else []
    return sorted((step, path) for path in paths if (step := checkpoint_step(path)) is not None)


class _Evaluator:
    def __init__(self, config, out):
        self.config, self.out = config, out
        self.continuous = config.mode == "continuous_eval"
        self.deadline = time.monotonic() + config.eval_timeout
        self.result = EvalResult(config.model_dir, {}, [])

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    # Set-up ----------------------------------------------------------------------------------

    def wait_for_record(self) -> dict:
        """config.json's flags, checked against this process's (the continuous evaluator waits for it)."""
        model_dir = self.config.model_dir
        waited = False
        while True:
            if os.path.exists(model_dir) and not os.path.isdir(model_dir):
                raise UserError(f"--model_dir={model_dir} is not a directory, so not a training run")
            recorded = run_record.read(model_dir) if os.path.isdir(model_dir) else None
            if recorded is not None:
                break
            if os.path.isdir(model_dir) and _holds_something_else(model_dir):
                raise UserError(
                    f"--model_dir={model_dir} is not a training run (no {run_record.FILE_NAME}); "
                    "give the --model_dir of a run"
                )
            if not self.continuous or time.monotonic() > self.deadline:
                raise UserError(
                    f"--model_dir={model_dir} is not a training run (no {run_record.FILE_NAME}"
                    + (f" after {self.config.eval_timeout:g} s, --eval_timeout" if self.continuous else "")
                    + "); give the --model_dir of a run, or start its training"
                )
            if not waited:
                self.say(
                    f"waiting      for {run_record.path(model_dir)} (training has not started; "
                    f"at most --eval_timeout={self.config.eval_timeout:g} s)"
                )
                waited = True
            time.sleep(POLL_SECONDS)
        changed = [d for d in run_record.differences(recorded, self.config) if d[0] not in _NOT_COMPARED]
        if changed and not self.config.allow_config_change:
            shown = ", ".join(f"--{name}={new!r} (the run has {old!r})" for name, old, new in changed)
            raise UserError(
                f"--model_dir={model_dir} was trained with other flags: {shown}; evaluate with "
                "the run's flags (see its config.json) or pass --allow_config_change"
            )
        return recorded

    def setup(self) -> None:
        config = self.config
        self.recorded = self.wait_for_record()
        self.placement = strategy_lib.build_strategy(config.strategy, config.cpu_replicas, config.collective_timeout)
        strategy_lib.per_replica_batch(config.global_batch, self.placement.num_replicas)
        seed = int(self.recorded.get("seed") or 0)
        job.seed_everything(seed, config.deterministic)
        task_class, self.data, _ = job.load_data(config)
        self.best = (
            BestKeeper(config.model_dir, config.best_metric, metric_names=metric_names(task_class))
            if config.best_metric
            else None
        )
        self.task, self.state = build_task_state(
            config, self.placement, task_class, self.data, seed=seed, total_steps=self.total_steps(), writable=False
        )
        check_collect(self.placement.strategy, self.task, evaluates=False)  # one process: only the names
        self.eval_data = pipelines.distributed_eval_data(self.placement.strategy, self.data, config)
        self.eval_loop = make_eval_loop(self.placement.strategy, self.task, run_eagerly=config.run_eagerly)
        self.writer = SummaryWriter(os.path.join(config.model_dir, "eval"))
        self.evaluated = _read_evaluated(config.model_dir)
        self.say(
            f"evaluator    {self.placement.name}: {self.placement.num_replicas} replica(s) on "
            f"{', '.join(self.placement.devices)}; {self.data.num_test} test examples of {self.data.name}; "
            f"run {config.model_dir}"
            + (f", last step {self.total_steps()}" if self.continuous else "")
            + (f"; {len(self.evaluated)} step(s) evaluated before" if self.evaluated else "")
        )

    def total_steps(self) -> int:
        """The run's last step from its record (re-read: a resumed run may have rewritten it)."""
        recorded = run_record.read(self.config.model_dir) or self.recorded
        if recorded.get("train_steps"):
            return int(recorded["train_steps"])
        if not recorded.get("epochs") or not recorded.get("global_batch"):
            raise UserError(
                f"{run_record.path(self.config.model_dir)} records neither train_steps nor epochs "
                "and global_batch: the run's last step is unknown"
            )
        return int(recorded["epochs"]) * pipelines.steps_per_epoch(self.data, int(recorded["global_batch"]))

    # Evaluation ------------------------------------------------------------------------------

    def evaluate_checkpoint(self, path: str, strict: bool = False) -> bool:
        """Restores `path` and evaluates it; False when its files were deleted meanwhile or cannot
        be read back (strict: that ends the job, in one line)."""
        try:
            self.state.checkpointer.restore(path)
        except CheckpointDamaged as err:
            if strict:
                raise
            if checkpoint_files(path):  # damaged: read only, never moved (a training resume sets it aside)
                self.say(f"warning      checkpoint {path} cannot be read back ({err.why}); skipped")
            else:
                self.say(
                    f"warning      checkpoint {path} was deleted before it could be read (the training "
                    "run keeps only --keep_checkpoints); skipped"
                )
            self.result.skipped.append(path)
            return False
        step = self.state.step
        metrics, line = evaluate_split(self.eval_loop, self.eval_data, self.task, self.data.num_test, step)
        self.writer.write_scalars(step, metrics)
        self.writer.flush()
        self.evaluated.add(step)  # recorded at once: a killed evaluator's successor skips this step
        _write_evaluated(self.config.model_dir, self.evaluated)
        self.say(line + f"  [{os.path.basename(path)}]")
        self.result.evaluated[step] = metrics
        if self.best is not None:
            kept = self.best.update(step, metrics, self.state.checkpointer.checkpoint, self.task.model)
            if kept:
                self.say(kept)
        return True

    def run(self) -> EvalResult:
        self.setup()
        try:
            if self.continuous:
                self.run_continuous()
            else:
                self.run_once()
        finally:
            self.writer.close()
        return self.result

    def run_once(self) -> None:
        path = self.config.checkpoint
        if path:
            if not tf.io.gfile.exists(path + ".index"):
                raise UserError(
                    f"--checkpoint={path}: no such checkpoint (expected {path}.index); give a "
                    "prefix such as RUN/checkpoints/ckpt-600"
                )
            self.evaluate_checkpoint(path, strict=True)  # a damaged one: its one line, exit 2
            return
        listed = listed_checkpoints(self.config.model_dir)
        if not listed:
            raise UserError(f"--model_dir={self.config.model_dir} holds no checkpoint yet; nothing to evaluate")
        for _, path in reversed(listed):  # the newest that reads back; a damaged one is skipped, in one line
            if self.evaluate_checkpoint(path):
                return
        raise UserError(
            f"no checkpoint of --model_dir={self.config.model_dir} could be read ("
            + ", ".join(os.path.basename(p) for p in self.result.skipped)
            + "); run again, or resume its training (which sets damaged checkpoints aside)"
        )

    def run_continuous(self) -> None:
        skipped = set()
        last_new = time.monotonic()
        waiting_said = False
        while True:
            total = self.total_steps()
            pending = [
                (step, path)
                for step, path in listed_checkpoints(self.config.model_dir)
                if step not in self.evaluated and path not in skipped
            ]
            for _, path in pending:
                if not self.evaluate_checkpoint(path):
                    skipped.add(path)
                last_new = time.monotonic()
            if self.evaluated and max(self.evaluated) >= total:
                self.say(f"done         evaluated the run's last step {total}")
                return
            idle = time.monotonic() - last_new
            if idle > self.config.eval_timeout:
                if not self.evaluated and not self.result.skipped:
                    raise UserError(
                        f"--model_dir={self.config.model_dir}: no checkpoint within --eval_timeout="
                        f"{self.config.eval_timeout:g} s"
                    )
                self.say(
                    f"done         no new checkpoint for {idle:.0f} s (--eval_timeout); stopping before the "
                    f"run's last step {total}"
                )
                return
            if not pending and not waiting_said:
                self.say("waiting      for the next checkpoint")
                waiting_said = True
            elif pending:
                waiting_said = False
            time.sleep(POLL_SECONDS)


def _holds_something_else(model_dir: str) -> bool:
    """A directory that has content but neither a run record nor checkpoints: not a training run.
    (A starting run's directory is empty until its config.json appears.)"""
    names = {name for name in os.listdir(model_dir) if not name.startswith(".") and name != "lost+found"}
    return bool(names) and not names & {"checkpoints", "train", "eval"}


def _evaluated_path(model_dir: str) -> str:
    return os.path.join(model_dir, "eval", EVALUATED_FILE)


def _read_evaluated(model_dir: str) -> set:
    try:
        with open(_evaluated_path(model_dir)) as f:
            return {int(step) for step in json.load(f)["steps"]}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read {_evaluated_path(model_dir)} ({err}); fix or delete it") from None


def _write_evaluated(model_dir: str, steps: set) -> None:
    target = _evaluated_path(model_dir)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".tmp", "w") as f:
        json.dump({"steps": sorted(steps)}, f)
        f.write("\n")
    os.replace(target + ".tmp", target)
