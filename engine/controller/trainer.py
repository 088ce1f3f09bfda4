"""Running a built run (engine/controller/build.py): the outer loop over compiled loops, deciding
between them when to log, evaluate, checkpoint and call the actions (engine/controller/actions/),
and the rollback of a bad step. Everything numeric happens in engine/loop.py, engine/update.py and
engine/task.py; what is built and checkpointed lives in engine/controller/state.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
import traceback

import tensorflow as tf

from engine import user_code
from engine.controller import error_files, job, preflight, run_lock, storage
from engine.controller.actions.base import ActionContext
from engine.controller.actions.export import Export
from engine.controller.build import BuiltRun, build_run
from engine.controller.evaluation import evaluate_split
from engine.distribute import stall
from engine.distribute.cluster import parse_tf_config
from engine.distribute.launch import RESTARTS_ENV
from engine.distribute.preemption import Watch
from engine.distribute.watchdog import PeerWatchdog, collective_failure
from engine.errors import ExtraFailed, NonFiniteLoss, Preempted, StopRun
from engine.loop import ratios
from engine.observe import report


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
    action_outputs: dict = dataclasses.field(default_factory=dict)  # what each action returned last, by key


def train(config, out=None) -> RunResult:
    """Runs one training job as `config` says; returns what it achieved."""
    out = out or sys.stdout
    # --precision's dtype policy; bad input records -> one line; one training run per --model_dir
    with job.context(config), run_lock.held(config, out):
        trainer = None
        try:
            trainer = Trainer(build_run(config, out))
            return trainer.run()
        except (tf.errors.OpError, OSError, UnicodeDecodeError) as err:
            if trainer is not None and job.from_input_pipeline(err):  # a bad record mid-run: what is kept
                raise job.input_failed(err, config, trainer.step, trainer.kept()) from None
            if isinstance(err, UnicodeDecodeError):
                raise
            failure = _write_failure(err, config)
            if failure is not None:
                raise failure from None
            if not isinstance(err, tf.errors.OpError):
                raise
            if config.strategy != "multi_worker_mirrored" or job.from_input_pipeline(err):
                raise
            raise collective_failure(err, parse_tf_config(os.environ.get("TF_CONFIG"))) from None


def _write_failure(err, config):
    """A storage fault of a write into --model_dir that no site named (an event file written
    between loops, ...) as one line (StorageFailed); None for any other error."""
    cause = storage.cause(err)
    if cause is None or (isinstance(err, tf.errors.OpError) and job.from_input_pipeline(err)):
        return None
    text = str(err) if isinstance(err, tf.errors.OpError) else str(getattr(err, "filename", "") or "")
    dirs = tuple({config.model_dir, os.path.abspath(config.model_dir)})
    where = next((word.rstrip(";:,") for word in text.split() if word.startswith(dirs)), None)
    if where is None:
        return None  # not a write into the run (a data file it cannot read, say)
    what = "writing the TensorBoard event file" if ".tfevents." in where else "writing"
    return storage.failed(f"{what} {where}", cause, config.model_dir)


class Trainer:
    """Runs one built run to its end; holds what changes while it runs (the step, the last metrics,
    what the actions returned, the counters of the run's result)."""

    def __init__(self, built: BuiltRun):
        self.built = built
        self.step = self.saved_step = built.start_step
        self.checkpoint_path = built.checkpoint_path
        self.eval_metrics, self.train_metrics, self.loop_outputs, self.outputs = {}, {}, {}, {}
        self.trained_examples, self.training_seconds, self.first_loop_seconds, self.skipped_steps = 0, 0.0, None, 0
        self.stop_reason, self.save_requested, self.stall_watch = None, False, None
        self.train_data = built.train_data
        self.iterator = None

    def run(self) -> RunResult:
        built = self.built
        config, cluster = built.config, built.placement.cluster
        peers = PeerWatchdog(cluster, config.collective_timeout) if cluster else None
        self.stall_watch = (
            stall.StallWatch(
                config.stall_timeout,
                config.model_dir,
                built.state.global_step,
                built.fetched,
                built.eval_batches,
                worker=cluster.task_index if cluster else 0,
                num_workers=cluster.num_workers if cluster else 1,
            )
            if config.stall_timeout
            else None
        )
        restarts = os.environ.get(RESTARTS_ENV)
        if restarts and built.placement.is_chief:
            built.writers["train"].write_scalars(self.step, {"restarts": float(restarts)})
        failing = False
        try:
            if self.stall_watch is not None:
                self.stall_watch.start()
            if peers:
                peers.start()
            self._train()
            self._finish()
            if peers:
                peers.stop()  # the last collective is done; a worker that exits now is not lost
        except BaseException:
            failing = True
            raise
        finally:
            if self.stall_watch is not None:
                self.stall_watch.stop()
            built.monitor.stop_profiler()
            if peers:
                peers.stop()
            for writer in built.writers.values():
                try:
                    writer.close()
                except tf.errors.OpError:
                    if not failing:  # the failure on its way out says more (a full disk refuses the flush too)
                        raise
            built.state.checkpointer.close()
        return self._result()

    def kept(self) -> str:
        """What a run that fails now keeps, and how to go on (nothing after the last checkpoint is claimed)."""
        if self.checkpoint_path is None and self.saved_step == 0:
            return "; nothing was saved (no checkpoint yet): fix the file, then rerun"
        return (
            f"; nothing was saved after step {self.saved_step}"
            + (f": {self.checkpoint_path} is intact" if self.checkpoint_path else "")
            + "; fix or replace the file, then rerun the same command to resume"
        )

    def _train(self) -> None:
        """Compiled loops until the last step, a stop request or a signal."""
        built, total = self.built, self.built.schedule.total_steps
        with Watch(built.placement.strategy, built.placement.num_workers) as watch:
            if self.step >= total:
                built.progress.message(f"model_dir already holds step {self.step} of {total}: nothing to train")
            if built.config.preflight and self.step < total:
                built.progress.message(preflight.check(self))
                if self.stall_watch is not None:
                    self.stall_watch.touch()
            self.iterator = iter(self.train_data)
            if built.rollback is not None and self.checkpoint_path is None and self.step == 0:
                self.save()  # something to roll back to before the first scheduled checkpoint
            while self.step < total and not self.stop_reason:
                if self.step > built.start_step and watch.stop_requested():  # at a loop boundary, everywhere
                    self._stop_for(watch.signal_name)
                self.run_loop()

    def _finish(self) -> None:
        """The stop's checkpoint, the last evaluation, then every action's at_end (every worker)."""
        if self.stop_reason:
            if self.saved_step != self.step:
                self.save()
            self.built.progress.message(self.stop_reason)
        if not self.eval_metrics and self.built.schedule.eval_every >= 0:
            self.evaluate()
        self._call_actions("at_end")  # every worker: an action may run collectives

    def _stop_for(self, signal_name):
        if self.saved_step != self.step:
            self.save()
        raise Preempted(
            f"{signal_name or 'a signal to another worker'} at step {self.step}: checkpoint "
            f"{self.checkpoint_path or 'saved by the chief'}; rerun the same command to resume "
            "(a second signal ends the run at once)"
        )

    def run_loop(self):
        """One compiled loop, then what is due after it: scalars, progress, checkpoint, actions, eval."""
        built, config, step = self.built, self.built.config, self.step
        num_steps = built.schedule.next_loop_steps(step)
        first_call = self.first_loop_seconds is None
        built.monitor.before_loop(step, first_call)
        loop_start = time.perf_counter()
        result = built.train_loop(self.iterator, tf.constant(num_steps, dtype=tf.int32))
        seconds = time.perf_counter() - loop_start
        ran, bad = int(result["steps"].numpy()), int(result["bad_steps"].numpy())
        if config.on_nonfinite != "skip" and bad:
            self._bad_step(step + ran + 1)
            return
        self._loop_metrics(result, bad, step, num_steps)
        self.step = step = step + num_steps
        if first_call:
            self.first_loop_seconds = time.perf_counter() - built.started
        examples_per_sec = num_steps * config.global_batch / seconds
        built.writers["train"].write_scalars(
            step,
            {
                **self.train_metrics,
                **_update_scalars(built.task.updater, result),
                "learning_rate": float(result["learning_rate"].numpy()),
                "steps_per_sec": num_steps / seconds,
                "examples_per_sec": examples_per_sec,
                "loop_seconds": seconds,
            },
            every_loop=True,
        )
        built.monitor.after_loop(step, first_call)
        self.loop_outputs = result
        built.progress.update(step, self.train_metrics, examples_per_sec)
        if not first_call:  # the first loop includes tracing: left out of the run's throughput
            # The loop and the host work after it (metrics, scalars, progress); checkpoints,
            # evaluations and actions are not training.
            self.trained_examples += num_steps * config.global_batch
            self.training_seconds += time.perf_counter() - loop_start
        if built.schedule.checkpoint_due(step):  # before the actions and the evaluation: they cannot lose it
            self.save()
            built.writers["train"].flush()
        self._call_actions("after_loop")
        if built.schedule.eval_due(step):
            self.evaluate()

    def _loop_metrics(self, result, bad: int, step: int, num_steps: int) -> None:
        """The loop's reduced metrics (and derived ones); the skipped steps' line with --on_nonfinite=skip."""
        task = self.built.task
        self.train_metrics = ratios(result["totals"])
        for name in task.updater.summary_names:  # nan: that optimizer got no gradients in the loop
            if math.isnan(self.train_metrics.get(name, 0.0)):
                del self.train_metrics[name]
        self.train_metrics.update(task.derived_metrics(self.train_metrics))
        self.skipped_steps += bad
        if bad:
            self.built.progress.message(
                f"skipped {bad} of steps {step + 1}-{step + num_steps}: non-finite loss "
                f"or gradient, weights and optimizer left as they were "
                f"({self.skipped_steps} skipped in this run)"
            )

    def _bad_step(self, bad_step: int) -> None:
        """A bad step with --on_nonfinite=stop or rollback: roll back while allowed, else stop (NON_FINITE)."""
        config, rollback = self.built.config, self.built.rollback
        if rollback is not None and rollback.allowed(self.built.state):
            self.roll_back(bad_step)
            return
        raise NonFiniteLoss(
            f"{_bad_step_cause(config)} at step {bad_step} (NaN, Inf or spike on at least one replica); "
            f"nothing saved after step {self.saved_step}"
            + (f" ({self.checkpoint_path})" if self.checkpoint_path else "")
            + (f"; {config.max_rollbacks} rollbacks made" if rollback is not None else "")
            + "; lower --learning_rate, check the data, or use --on_nonfinite=skip or rollback"
        )

    def roll_back(self, bad_step: int) -> None:
        """--on_nonfinite=rollback (engine/controller/rollback.py): the last checkpoint restored, the
        restored step saved again with the data position past the bad batch, the data and its
        iterator rebuilt from there."""
        built = self.built
        restored, count, line = built.rollback.restore(built.state, bad_step)
        self.step = restored
        self.save()  # the restored step, now with the data position past the bad batch
        self.train_data = built.distributed_train_data()
        self.iterator = iter(self.train_data)
        built.writers["train"].write_scalars(restored, {"rollbacks": float(count)})
        built.progress.message(line)

    def evaluate(self):
        built = self.built
        metrics, line = self._evaluate_split()
        built.writers["eval"].write_scalars(self.step, metrics)
        built.progress.message(line)
        self.eval_metrics = metrics
        self._call_actions("after_eval")

    def _evaluate_split(self) -> tuple[dict, str]:
        built = self.built
        return evaluate_split(built.eval_loop, built.eval_data, built.task, built.data.num_test, self.step)

    def save(self):
        built = self.built
        if self.stall_watch is not None:
            self.stall_watch.touch()  # a long checkpoint write is progress, not a stall
        try:
            path = built.state.save(self.step, built.schedule.epoch(self.step))
        except (tf.errors.OpError, OSError) as err:
            cause = storage.cause(err)
            if cause is None:
                raise
            directory = built.state.checkpointer.manager.directory
            raise storage.failed(
                f"saving checkpoint ckpt-{self.step} into {directory}",
                cause,
                built.config.model_dir,
                step=self.step,
                saved_in=directory,
            ) from None
        self.saved_step = self.step
        self.checkpoint_path = path  # the chief's checkpoint of this step, on every worker
        if built.placement.is_chief:
            for line in built.state.untracked_warnings():
                built.progress.message(line)

    # ---- the actions (engine/controller/actions/base.py) ----
    def _call_actions(self, hook: str) -> None:
        """Calls `hook` of every action in order, each with a fresh context (it sees what the ones
        before it returned); keeps each non-None return; then the checkpoint an action asked for."""
        for action in self.built.actions:
            with self.extra(action.name):
                produced = getattr(action, hook)(self._context())
            if produced is not None:
                self.outputs[action.key] = produced
        if self.save_requested:
            self.save_requested = False
            if self.saved_step != self.step:
                self.save()

    def _context(self) -> ActionContext:
        built = self.built
        return ActionContext(
            step=self.step,
            config=built.config,
            task=built.task,
            is_chief=built.placement.is_chief,
            writers=built.writers,
            data_spec=built.data.spec,
            checkpoint=built.state.checkpointer.checkpoint,
            train_metrics=self.train_metrics,
            loop_outputs=self.loop_outputs,
            eval_metrics=self.eval_metrics,
            outputs=self.outputs,
            message=built.progress.message,
            request_stop=self.request_stop,
            request_save=self.request_save,
            evaluate=self._evaluate_split,
            write_eval_extras=lambda: built.monitor.after_eval(self.step),
            export_weights=self.export_weights,
        )

    def request_stop(self, reason: str) -> None:
        """Training ends cleanly at the next loop boundary (checkpoint, evaluation, export)."""
        self.stop_reason = self.stop_reason or reason

    def request_save(self) -> None:
        """A checkpoint of this step once the current hook's actions are done (if none is saved yet)."""
        self.save_requested = True

    def export_weights(self):
        """A block in which the model holds the weights to export or keep as best (the EMA ones with --ema_decay)."""
        ema = self.built.task.updater.ema
        return ema.swapped() if ema is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def extra(self, what: str):
        """Host-side work after training steps (summaries, best, export): a failure there ends the
        run in one line (ExtraFailed) and keeps the checkpoint written before it (invariant 12)."""
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
            where = user_code.user_frame(err)
            written = self._write_traceback(err, what)
            raise ExtraFailed(
                f"{what} failed at step {self.step}: {type(err).__name__}: {first_line}"
                + (f" (at {where})" if where else "")
                + f"; {saved}; the full traceback is in {written}; "
                "fix the cause, then the same command continues from the checkpoint"
            ) from err

    def _write_traceback(self, err: BaseException, what: str) -> str:
        """<model_dir>/errors/step-N-<time>.txt with the failure's whole traceback (chief only); its path."""
        return error_files.write(
            self.built.config.model_dir,
            f"step-{self.step}",
            f"{what} failed at step {self.step}",
            "".join(traceback.format_exception(type(err), err, err.__traceback__)),
            self.built.placement.is_chief,
        )

    def _result(self) -> RunResult:
        built = self.built
        wall = time.perf_counter() - built.started
        throughput = (
            self.trained_examples / self.training_seconds
            if self.training_seconds
            else ((self.step - built.start_step) * built.config.global_batch / max(wall, 1e-9))
        )
        exported = self.outputs.get(Export.key)
        result = RunResult(
            model_dir=built.config.model_dir,
            start_step=built.start_step,
            final_step=self.step,
            eval_metrics=self.eval_metrics,
            train_metrics=self.train_metrics,
            train_examples_per_sec=throughput,
            wall_seconds=wall,
            seconds_to_first_loop=self.first_loop_seconds or 0.0,
            export_path=exported[0] if exported else None,
            checkpoint_path=self.checkpoint_path,
            skipped_steps=self.skipped_steps,
            stopped_early=self.stop_reason,
            action_outputs=dict(self.outputs),
        )
        if built.placement.is_chief:
            report.summary(result, built.out)
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
