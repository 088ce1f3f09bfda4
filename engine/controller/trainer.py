"""The outer loop: build everything, then run compiled loops and decide between them when to
log, evaluate and checkpoint. Everything numeric happens in engine/loop.py, engine/update.py and
engine/task.py; what is built and checkpointed lives in engine/controller/state.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time

import tensorflow as tf

from engine import __version__
from engine.config import resolved_input_mode
from engine.data import pipelines
from engine.observe import report
from engine.controller import job, run_record
from engine.controller.state import build_task_state
from engine.controller.evaluation import evaluate_split
from engine.controller.actions import engine_actions
from engine.controller.rollback import Rollback
from engine.distribute import strategy as strategy_lib
from engine.distribute.agreement import agree
from engine.distribute.cluster import parse_tf_config
from engine.errors import ExtraFailed, NonFiniteLoss, Preempted, StopRun, UserError
from engine.loop import make_eval_loop, make_train_loop, ratios
from engine.observe.monitor import Monitor, parse_profile_steps
from engine.distribute.preemption import Watch
from engine.observe.progress import Progress
from engine.controller.schedule import Schedule
from engine.observe.summaries import create_writers
from engine.distribute import stall
from engine.distribute.launch import RESTARTS_ENV
from engine.distribute.watchdog import PeerWatchdog, collective_failure


@dataclasses.dataclass
class RunResult:
    model_dir: str
    start_step: int
    final_step: int
    eval_metrics: dict
    train_metrics: dict
    train_examples_per_sec: float
    wall_seconds: float
    seconds_to_first_loop: float
    export_path: str | None
    checkpoint_path: str | None
    skipped_steps: int = 0  # bad steps skipped with --on_nonfinite=skip
    stopped_early: str | None = None  # why training ended before its last step (early stopping)


def train(config, out=None) -> RunResult:
    """Runs one training job as `config` says; returns what it achieved."""
    with job.context(config):  # --precision's dtype policy; bad input records -> one line
        try:
            return _train(config, out or sys.stdout)
        except tf.errors.OpError as err:
            if config.strategy != "multi_worker_mirrored" or job.from_input_pipeline(err):
                raise
            raise collective_failure(err, parse_tf_config(os.environ.get("TF_CONFIG"))) from None


def _setup(config, out):
    """Strategy, agreed seed, data, schedule, Task and its restored state."""
    started = time.perf_counter()
    config_changes = run_record.check_resume(config)  # before anything is built or written
    placement = strategy_lib.build_strategy(config.strategy, config.cpu_replicas, config.collective_timeout)
    if placement.is_chief:
        run_record.create_model_dir(config.model_dir)
    per_replica = strategy_lib.per_replica_batch(config.global_batch, placement.num_replicas, config.grad_accum_steps)
    seed = config.seed if config.seed is not None else random.randrange(2**31)
    cluster = placement.cluster
    if cluster is not None:
        if config.num_workers and config.num_workers != cluster.num_workers:
            raise UserError(f"--num_workers={config.num_workers} but TF_CONFIG lists {cluster.num_workers} workers")
        agreement_start = time.perf_counter()
        seed = agree(placement.strategy, config, cluster, seed)
        out.write(
            f"agreement    all {cluster.num_workers} workers run the same flags "
            f"(checked in {time.perf_counter() - agreement_start:.3f} s)\n"
        )
    job.seed_everything(seed, config.deterministic)

    task_class, data, steps_per_epoch = job.load_data(config)
    # class_names (label i is class_names[i]) only where the source names its classes
    data_facts = {
        name: value
        for name, value in (
            ("class_names", list(data.spec.class_names or [])),
            ("data_order", run_record.data_order(data)),
        )
        if value
    }
    data_changed = run_record.check_data_facts(config, data_facts)
    eval_every = config.eval_every
    if cluster is not None and cluster.has_evaluator and eval_every >= 0:
        eval_every = -1  # the sidecar evaluates each checkpoint; never both
        out.write("evaluator    TF_CONFIG lists an evaluator task: it evaluates the checkpoints, training does not\n")
    schedule = Schedule(
        total_steps=config.train_steps or config.epochs * steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        steps_per_loop=config.steps_per_loop,
        eval_every=eval_every,
        checkpoint_every=config.checkpoint_every,
        histogram_every=config.histogram_every,
        marks=parse_profile_steps(config.profile_steps) or (),
    )
    if config.loss_upper_bound and "loss" not in task_class.train_metrics:
        raise UserError(
            f"--loss_upper_bound={config.loss_upper_bound:g}: --task={config.task} reports no "
            f"training 'loss' (it reports {', '.join(task_class.train_metrics)})"
        )
    if config.early_stopping_patience and eval_every < 0:
        raise UserError(
            f"--early_stopping_patience={config.early_stopping_patience} needs training to evaluate: "
            "drop --eval_every=-1 and TF_CONFIG's evaluator task"
        )
    task, state = build_task_state(config, placement, task_class, data, seed=seed, total_steps=schedule.total_steps)
    actions = engine_actions(config, task, is_chief=placement.is_chief)  # before training: bad flags refused now
    checkpoint_path = state.restore()
    start_step = state.step
    for action in actions:
        action.resume_at(start_step)
    input_mode = resolved_input_mode(config, data, augmented=task.example_augmentation(task.seed) is not None)
    report.banner(config, placement, data, per_replica, schedule, task.seed, task.model, start_step, out, input_mode)
    run_facts = {
        "engine_version": __version__,
        "replicas": placement.num_replicas,
        "effective_seed": task.seed,
        **data_facts,
    }
    if placement.is_chief and (start_step == 0 or config_changes or data_changed):
        run_record.write(config, run_facts)
    return _Run(
        config=config,
        out=out,
        started=started,
        placement=placement,
        data=data,
        schedule=schedule,
        task=task,
        state=state,
        run_facts=run_facts,
        start_step=start_step,
        checkpoint_path=checkpoint_path,
        actions=actions,
    )


def _train(config, out) -> RunResult:
    return _setup(config, out).train()


@dataclasses.dataclass
class _Run:
    """One run between set-up and summary: the loop over compiled loops and what happens between them."""

    config: object
    out: object
    started: float
    placement: object
    data: object
    schedule: Schedule
    task: object
    state: object
    run_facts: dict
    start_step: int
    checkpoint_path: str | None
    actions: list = dataclasses.field(default_factory=list)  # engine/controller/actions, in order

    def __post_init__(self):
        config, strategy, task = self.config, self.placement.strategy, self.task
        self.step = self.saved_step = self.start_step
        self.eval_metrics, self.train_metrics = {}, {}
        self.trained_examples, self.training_seconds, self.first_loop_seconds, self.skipped_steps = 0, 0.0, None, 0
        self.ema_metrics, self.last_result, self.export_path, self.stop_reason = {}, None, None, None
        self.stall_watch = None
        self.writers = create_writers(
            config.model_dir,
            self.placement.is_chief,
            ("train", "eval", "eval_ema") if config.ema_decay else ("train", "eval"),
        )
        self.monitor = Monitor(config, self.writers, task, self.data, is_chief=self.placement.is_chief)
        if self.start_step == 0:
            self.monitor.at_start(report.config_markdown(config, self.run_facts), self.run_facts)
        self.train_data = self._train_data()
        # The stall watch's counters, kept by the compiled loops only when it watches (one add per step).
        self.fetched, self.eval_batches = stall.counters() if config.stall_timeout else (None, None)
        self.eval_data = pipelines.distributed_eval_data(strategy, self.data, config)
        self.train_loop = make_train_loop(
            strategy,
            task,
            self.state.global_step,
            accum_steps=config.grad_accum_steps,
            jit_compile=config.jit_compile,
            skip_nonfinite=config.on_nonfinite == "skip",
            update_summaries=config.summaries == "full",
            gradients=config.histogram_every > 0,
            models=self.state.models,
            strategy_name=config.strategy,
            loss_upper_bound=config.loss_upper_bound,
            fetched=self.fetched,
        )
        self.rollback = Rollback(config.max_rollbacks) if config.on_nonfinite == "rollback" else None
        self.eval_loop = make_eval_loop(strategy, task, progress=self.eval_batches)
        self.progress = Progress(
            self.schedule.total_steps,
            self.schedule.steps_per_epoch,
            self.start_step,
            stream=self.out,
            enabled=self.placement.is_chief,
        )

    def _train_data(self):
        """The distributed training data from the state's data position (steps + batches skipped by rollbacks)."""
        return pipelines.distributed_train_data(
            self.placement.strategy,
            self.data,
            self.config,
            self.task.seed,
            skip_batches=self.state.data_position,
            augment=self.task.example_augmentation(self.task.seed),
        )

    def evaluate(self):
        metrics, line = evaluate_split(self.eval_loop, self.eval_data, self.task, self.data.num_test, self.step)
        self.writers["eval"].write_scalars(self.step, metrics)
        self.progress.message(line)
        self.eval_metrics = metrics
        for action in self.actions:
            with self._extra(action.name):
                action.after_eval(self, metrics)

    # ---- what actions see (engine/controller/actions/base.py) ----
    def message(self, line: str) -> None:
        self.progress.message(line)

    def request_stop(self, reason: str) -> None:
        """Training ends cleanly at the next loop boundary (checkpoint, evaluation, export)."""
        self.stop_reason = self.stop_reason or reason

    @property
    def selection_metrics(self) -> dict:
        """What --best_metric and early stopping judge: the EMA weights' metrics when EMA is on."""
        return self.ema_metrics if self.config.ema_decay else self.eval_metrics

    def weights_for_export(self):
        """A block in which the model holds the weights to export or keep as best (the EMA ones with --ema_decay)."""
        ema = self.task.updater.ema
        return ema.swapped() if ema is not None else contextlib.nullcontext()

    def save_model(self, path: str) -> None:
        with self.weights_for_export():
            self.task.export_model().save(path)

    @contextlib.contextmanager
    def _extra(self, what: str):
        """Host-side work after training steps (summaries, best, export): a failure there ends the
        run in one line (exit 1) and keeps the checkpoint written before it (invariant 12)."""
        try:
            yield
        except (StopRun, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001 - any failure of an extra: one line, training kept
            saved = (
                (
                    f"training up to step {self.saved_step} is saved"
                    + (f" ({self.checkpoint_path})" if self.checkpoint_path else "")
                )
                if self.saved_step
                else "no checkpoint was written yet"
            )
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            raise ExtraFailed(
                f"{what} failed at step {self.step}: {type(err).__name__}: {first_line}; {saved}; "
                "rerun the same command to continue from it"
            ) from err

    def save(self):
        if self.stall_watch is not None:
            self.stall_watch.touch()  # a long checkpoint write is progress, not a stall
        path = self.state.save(self.step, self.schedule.epoch(self.step))
        self.saved_step = self.step
        if self.placement.is_chief:
            self.checkpoint_path = path
            for line in self.state.untracked_warnings():
                self.progress.message(line)

    def train(self) -> RunResult:
        config, cluster = self.config, self.placement.cluster
        peers = PeerWatchdog(cluster, config.collective_timeout) if cluster else None
        self.stall_watch = (
            stall.StallWatch(
                config.stall_timeout,
                config.model_dir,
                self.state.global_step,
                self.fetched,
                self.eval_batches,
                worker=cluster.task_index if cluster else 0,
                num_workers=cluster.num_workers if cluster else 1,
            )
            if config.stall_timeout
            else None
        )
        restarts = os.environ.get(RESTARTS_ENV)
        if restarts and self.placement.is_chief:
            self.writers["train"].write_scalars(self.step, {"restarts": float(restarts)})
        try:
            if self.stall_watch is not None:
                self.stall_watch.start()
            if peers:
                peers.start()
            with Watch(self.placement.strategy, self.placement.num_workers) as watch:
                if self.step >= self.schedule.total_steps:
                    self.progress.message(
                        f"model_dir already holds step {self.step} of {self.schedule.total_steps}: nothing to train"
                    )
                self.iterator = iter(self.train_data)
                if self.rollback is not None and self.checkpoint_path is None and self.step == 0:
                    self.save()  # something to roll back to before the first scheduled checkpoint
                while self.step < self.schedule.total_steps and not self.stop_reason:
                    if self.step > self.start_step and watch.stop_requested():  # at a loop boundary, everywhere
                        self._stop_for(watch.signal_name)
                    self.run_loop()
            if self.stop_reason:
                if self.saved_step != self.step:
                    self.save()
                self.progress.message(self.stop_reason)
            if not self.eval_metrics and self.schedule.eval_every >= 0:
                self.evaluate()
            for action in self.actions:  # every worker: an action may run collectives
                with self._extra(action.name):
                    action.at_end(self)
            if peers:
                peers.stop()  # the last collective is done; a worker that exits now is not lost
        finally:
            if self.stall_watch is not None:
                self.stall_watch.stop()
            self.monitor.stop_profiler()
            if peers:
                peers.stop()
            for writer in self.writers.values():
                writer.close()
            self.state.checkpointer.close()
        return self._result(self.export_path)

    def _stop_for(self, signal_name):
        if self.saved_step != self.step:
            self.save()
        raise Preempted(
            f"{signal_name or 'a signal to another worker'} at step {self.step}: checkpoint "
            f"{self.checkpoint_path or 'saved by the chief'}; rerun the same command to resume "
            "(a second signal ends the run at once)"
        )

    def run_loop(self):
        """One compiled loop, then what is due after it: scalars, progress, eval, checkpoint."""
        config, schedule, task, step = self.config, self.schedule, self.task, self.step
        num_steps = schedule.next_loop_steps(step)
        first_call = self.first_loop_seconds is None
        self.monitor.before_loop(step, first_call)
        loop_start = time.perf_counter()
        result = self.train_loop(self.iterator, tf.constant(num_steps, dtype=tf.int32))
        seconds = time.perf_counter() - loop_start
        ran, bad = int(result["steps"].numpy()), int(result["bad_steps"].numpy())
        if config.on_nonfinite != "skip" and bad:
            bad_step = step + ran + 1
            if self.rollback is not None and self.rollback.allowed(self.state):
                self.progress.message(self.rollback.roll_back(self, bad_step))
                return
            raise NonFiniteLoss(
                f"{_bad_step_cause(config)} at step {bad_step} (NaN, Inf or spike on at least one replica); "
                f"nothing saved after step {self.saved_step}"
                + (f" ({self.checkpoint_path})" if self.checkpoint_path else "")
                + (f"; {config.max_rollbacks} rollbacks made" if self.rollback is not None else "")
                + "; lower --learning_rate, check the data, or use --on_nonfinite=skip or rollback"
            )
        self.train_metrics = ratios(result["totals"])
        for name in task.updater.summary_names:  # nan: that optimizer got no gradients in the loop
            if math.isnan(self.train_metrics.get(name, 0.0)):
                del self.train_metrics[name]
        self.train_metrics.update(task.derived_metrics(self.train_metrics))
        self.skipped_steps += bad
        if bad:
            self.progress.message(
                f"skipped {bad} of steps {step + 1}-{step + num_steps}: non-finite loss "
                f"or gradient, weights and optimizer left as they were "
                f"({self.skipped_steps} skipped in this run)"
            )
        self.step = step = step + num_steps
        if first_call:
            self.first_loop_seconds = time.perf_counter() - self.started
        examples_per_sec = num_steps * config.global_batch / seconds
        self.writers["train"].write_scalars(
            step,
            {
                **self.train_metrics,
                **_update_scalars(task.updater, result),
                "learning_rate": float(result["learning_rate"].numpy()),
                "steps_per_sec": num_steps / seconds,
                "examples_per_sec": examples_per_sec,
                "loop_seconds": seconds,
            },
            every_loop=True,
        )
        self.monitor.after_loop(step, first_call)
        self.last_result = result
        self.progress.update(step, self.train_metrics, examples_per_sec)
        if not first_call:  # the first loop includes tracing: left out of the run's throughput
            # The loop and the host work after it (metrics, scalars, progress); checkpoints,
            # evaluations and actions are not training.
            self.trained_examples += num_steps * config.global_batch
            self.training_seconds += time.perf_counter() - loop_start
        if schedule.checkpoint_due(step):  # before the actions and the evaluation: they cannot lose it
            self.save()
            self.writers["train"].flush()
        for action in self.actions:
            with self._extra(action.name):
                action.after_loop(self)
        if schedule.eval_due(step):
            self.evaluate()

    def _result(self, export_path) -> RunResult:
        wall = time.perf_counter() - self.started
        throughput = (
            self.trained_examples / self.training_seconds
            if self.training_seconds
            else ((self.step - self.start_step) * self.config.global_batch / max(wall, 1e-9))
        )
        result = RunResult(
            model_dir=self.config.model_dir,
            start_step=self.start_step,
            final_step=self.step,
            eval_metrics=self.eval_metrics,
            train_metrics=self.train_metrics,
            train_examples_per_sec=throughput,
            wall_seconds=wall,
            seconds_to_first_loop=self.first_loop_seconds or 0.0,
            export_path=export_path,
            checkpoint_path=self.checkpoint_path,
            skipped_steps=self.skipped_steps,
            stopped_early=self.stop_reason,
        )
        if self.placement.is_chief:
            report.summary(result, self.out)
        return result


def _bad_step_cause(config) -> str:
    """What made a step bad, for the console line (the step number follows)."""
    if config.loss_upper_bound:
        return f"non-finite loss or gradient, or a loss above --loss_upper_bound={config.loss_upper_bound:g},"
    return "non-finite loss or gradient"


def _scalar(value) -> float:
    return float(tf.convert_to_tensor(value).numpy())


def _update_scalars(updater, result) -> dict:
    """Loss scale and updates skipped in the loop (overflows, bad steps), when loss scaling is on."""
    if not updater.loss_scaling:
        return {}
    return {"loss_scale": _scalar(updater.loss_scale), "skipped_updates": float(result["skipped_updates"].numpy())}
