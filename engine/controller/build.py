"""Building a run: everything the outer loop (engine/controller/trainer.py) needs before its first
step, returned as one `BuiltRun`: the strategy and the agreed seed, the data and the schedule, the
Task and its restored state, the actions, the TensorBoard writers and monitor, the distributed
data, the compiled loops and the console progress. Nothing here trains."""

from __future__ import annotations

import dataclasses
import random
import time

import tensorflow as tf

from engine import __version__
from engine.config import resolved_input_mode
from engine.controller import evaluation, job, run_record, storage
from engine.controller.actions import engine_actions
from engine.controller.rollback import Rollback
from engine.controller.schedule import Schedule
from engine.controller.state import build_task_state
from engine.data import pipelines
from engine.data.formats import describe_structure
from engine.distribute import stall
from engine.distribute import strategy as strategy_lib
from engine.distribute.agreement import agree
from engine.errors import UserError
from engine.loop import LoopOptions, make_eval_loop, make_train_loop
from engine.observe import report
from engine.observe.monitor import Monitor, parse_profile_steps
from engine.observe.progress import Progress
from engine.observe.summaries import create_writers


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    """One run, built and restored, before its first step. The trainer reads it and never changes it."""

    config: object
    out: object
    started: float  # time.perf_counter() when the build began
    placement: object  # engine/distribute/strategy.py: strategy, replicas, is_chief, cluster
    data: object
    schedule: Schedule
    task: object
    state: object  # engine/controller/state.py TrainState
    run_facts: dict
    start_step: int
    checkpoint_path: str | None  # the restored checkpoint (None: a fresh run)
    actions: tuple  # engine/controller/actions, in order
    writers: dict
    monitor: Monitor
    train_data: object  # the distributed training data from the restored data position
    eval_data: object
    train_loop: object
    eval_loop: object
    progress: Progress
    rollback: Rollback | None  # --on_nonfinite=rollback
    fetched: object  # the stall watch's counters (None without --stall_timeout)
    eval_batches: object

    def distributed_train_data(self):
        """The distributed training data from the state's data position (steps + batches skipped by rollbacks)."""
        return _train_data(self.config, self.placement, self.data, self.task, self.state)


def build_run(config, out) -> BuiltRun:
    """Strategy, agreed seed, data, schedule, Task and its restored state, actions, writers, loops."""
    started = time.perf_counter()
    config_changes = run_record.check_resume(config)  # before anything is built or written
    placement = strategy_lib.build_strategy(config.strategy, config.cpu_replicas, config.collective_timeout)
    if placement.is_chief:
        run_record.create_model_dir(config.model_dir)
    per_replica = strategy_lib.per_replica_batch(config.global_batch, placement.num_replicas, config.grad_accum_steps)
    seed = _agreed_seed(config, placement, out)
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
    schedule = _schedule(config, placement, steps_per_epoch, out)
    _check_flags(config, task_class, schedule)
    task, state = build_task_state(config, placement, task_class, data, seed=seed, total_steps=schedule.total_steps)
    evaluation.check_collect(placement.strategy, task, schedule.eval_every >= 0)
    actions = engine_actions(config, task, is_chief=placement.is_chief)  # before training: bad flags refused now
    checkpoint_path = state.restore()
    if state.checkpointer.resumed is not None:  # the newer checkpoints that did not read back, named
        out.write("".join(line + "\n" for line in state.checkpointer.resumed.lines()))
    start_step = state.step
    run_layout = run_record.layout(placement.num_workers, placement.num_replicas)
    if start_step:
        config_changes = [*config_changes, *run_record.layout_change(config, run_layout)]
    for action in actions:
        action.resume_at(start_step)
    augment = task.example_augmentation(task.seed)
    augmented = pipelines.training_example(data, augment)  # a structure the engine cannot batch: refused now
    input_mode = resolved_input_mode(config, data, augmented=augment is not None)
    report.banner(config, placement, data, per_replica, schedule, task.seed, task.model, start_step, out, input_mode)
    if start_step:  # every allowed change of a flag, and the state a flag added, named (invariant 14)
        out.write("".join(change.line(start_step) + "\n" for change in config_changes))
        out.write("".join(line + "\n" for line in state.initialised_lines))
    if augmented is not None and augmented != (data.spec.features, data.spec.labels):
        where = getattr(augment, "where", "Task.augment_example")
        out.write(
            f"note         {where} gives train_step {describe_structure(augmented)} per example; "
            f"evaluation and the export take the data's {describe_structure((data.spec.features, data.spec.labels))}\n"
        )
    run_facts = {
        "engine_version": __version__,
        "replicas": placement.num_replicas,
        run_record.LAYOUT: run_layout,
        "effective_seed": task.seed,
    }
    run_facts.update(data_facts)
    if placement.is_chief and (start_step == 0 or config_changes or data_changed):
        run_record.write(config, run_facts, config_changes if start_step else (), start_step)
    try:
        writers = create_writers(
            config.model_dir,
            placement.is_chief,
            ("train", "eval", "eval_ema") if config.ema_decay else ("train", "eval"),
        )
    except tf.errors.OpError as err:
        if storage.cause(err) is None:
            raise
        raise storage.failed(
            f"creating the TensorBoard event files in {config.model_dir}", storage.cause(err), config.model_dir
        ) from None

    monitor = Monitor(config, writers, task, data, is_chief=placement.is_chief)
    pictures_off = monitor.check_pictures()  # before training: a model the pictures do not fit is named now
    if pictures_off:
        out.write(f"note         classification pictures off: {pictures_off}\n")
    if start_step == 0:
        monitor.at_start(report.config_markdown(config, run_facts), run_facts)
    train_data = _train_data(config, placement, data, task, state)
    # The stall watch's counters, kept by the compiled loops only when it watches (one add per step).
    fetched, eval_batches = stall.counters() if config.stall_timeout else (None, None)
    return BuiltRun(
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
        actions=tuple(actions),
        writers=writers,
        monitor=monitor,
        train_data=train_data,
        eval_data=pipelines.distributed_eval_data(placement.strategy, data, config),
        train_loop=_train_loop(config, placement, task, state, fetched),
        eval_loop=make_eval_loop(placement.strategy, task, progress=eval_batches, run_eagerly=config.run_eagerly),
        progress=Progress(
            schedule.total_steps, schedule.steps_per_epoch, start_step, stream=out, enabled=placement.is_chief
        ),
        rollback=Rollback(config.max_rollbacks) if config.on_nonfinite == "rollback" else None,
        fetched=fetched,
        eval_batches=eval_batches,
    )


def _agreed_seed(config, placement, out) -> int:
    """The seed every worker agrees on (with the flags), every random generator seeded with it."""
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
    return seed


def _schedule(config, placement, steps_per_epoch: int, out) -> Schedule:
    eval_every = config.eval_every
    cluster = placement.cluster
    if cluster is not None and cluster.has_evaluator and eval_every >= 0:
        eval_every = -1  # the sidecar evaluates each checkpoint; never both
        out.write("evaluator    TF_CONFIG lists an evaluator task: it evaluates the checkpoints, training does not\n")
    return Schedule(
        total_steps=config.train_steps or config.epochs * steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        steps_per_loop=config.steps_per_loop,
        eval_every=eval_every,
        checkpoint_every=config.checkpoint_every,
        histogram_every=config.histogram_every,
        marks=parse_profile_steps(config.profile_steps) or (),
    )


def _check_flags(config, task_class, schedule: Schedule) -> None:
    """Flags that need what the Task reports or the schedule does, refused before anything is built."""
    if config.loss_upper_bound and "loss" not in task_class.train_metrics:
        raise UserError(
            f"--loss_upper_bound={config.loss_upper_bound:g}: --task={config.task} reports no "
            f"training 'loss' (it reports {', '.join(task_class.train_metrics)})"
        )
    if config.early_stopping_patience and schedule.eval_every < 0:
        raise UserError(
            f"--early_stopping_patience={config.early_stopping_patience} needs training to evaluate: "
            "drop --eval_every=-1 and TF_CONFIG's evaluator task"
        )


def _train_data(config, placement, data, task, state):
    return pipelines.distributed_train_data(
        placement.strategy,
        data,
        config,
        task.seed,
        skip_batches=state.data_position,
        augment=task.example_augmentation(task.seed),
    )


def _train_loop(config, placement, task, state, fetched):
    options = LoopOptions.from_config(config, models=state.models)
    return make_train_loop(placement.strategy, task, state.global_step, options, fetched=fetched)
