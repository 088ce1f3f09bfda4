"""The outer loop: build everything, then run compiled loops and decide between them when to
log, evaluate and checkpoint. Everything numeric happens in engine/loop.py and engine/task.py."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time

import keras
import tensorflow as tf

from engine import __version__
from engine import data as data_lib
from engine import run_record
from engine import strategy as strategy_lib
from engine.agreement import agree
from engine.checkpoints import Checkpointer
from engine.cluster import parse_tf_config
from engine.errors import NonFiniteLoss, Preempted, UserError
from engine.loop import make_eval_loop, make_train_loop, ratios
from engine.monitor import Monitor, parse_profile_steps
from engine.preemption import Watch
from engine.progress import Progress, format_duration
from engine.optimizers import constant_rate
from engine.randomness import per_replica_randomness, seed_generators
from engine.schedule import Schedule
from engine.summaries import create_writers
from engine.task_loader import load_task_class
from engine.update import Updater
from engine.watchdog import PeerWatchdog, collective_failure


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
    skipped_steps: int = 0  # steps skipped with --on_nonfinite=skip


def _scalar(value) -> float:
    return float(tf.convert_to_tensor(value).numpy())


def _banner(config, placement, data, per_replica, schedule, seed, model, start_step, out):
    lines = [
        f"strategy     {placement.name}: {placement.num_replicas} replica(s) in sync, this process on "
        f"{', '.join(placement.devices)}",
        *([f"cluster      {placement.cluster.describe()}"] if placement.cluster else []),
        f"global batch {config.global_batch} = {placement.num_replicas} "
        f"{'replica' if placement.num_replicas == 1 else 'replicas'} x {per_replica}"
        + (f" ({config.grad_accum_steps} micro-batches of {per_replica // config.grad_accum_steps} per replica, "
           "one update)" if config.grad_accum_steps > 1 else ""),
        f"update       {config.optimizer}, precision {config.precision}"
        + (f", clip global norm {config.clip_norm}" if config.clip_norm else "")
        + (f", weight decay {config.weight_decay}" if config.weight_decay else "")
        + (f", learning rate {config.lr_schedule}" if config.lr_schedule != "constant" else ""),
        f"data         {data.name}: {len(data.train_images)} train / {len(data.test_images)} test "
        f"images {data.image_shape}, from {data.source}",
        f"model        {config.model} ({model.count_params():,} parameters), task {config.task}, "
        f"input {config.input_mode}",
        f"schedule     {schedule.total_steps} steps ({schedule.total_steps / schedule.steps_per_epoch:.2f} "
        f"epochs of {schedule.steps_per_epoch}), {schedule.steps_per_loop} steps per compiled loop, "
        f"eval every {schedule.eval_interval}, checkpoint every {schedule.checkpoint_interval}",
        f"seed         {seed}" + (
            " (the resumed run's)" if start_step
            else "" if config.seed is not None else f" (random; --seed={seed} repeats it)"),
        f"model_dir    {config.model_dir}"
        + (f" (resuming at step {start_step})" if start_step else ""),
    ]
    if placement.name == "mirrored" and placement.num_replicas == 1:
        lines.append(
            "note         mirrored found a single device: this run is not distributed "
            "(use --cpu_replicas=N to split the CPU into N replicas)"
        )
    out.write("\n".join(lines) + "\n")
    out.flush()


def build_task(strategy, task) -> None:
    """Inside strategy.scope(): the Task's model, its optimizer (built: invariant 1) and the
    engine's updater, every variable checked to be in the scope."""
    task.model = task.build_model()
    per_replica_randomness(task.model)  # Dropout & co. draw differently on each replica
    strategy_lib.check_variables_in_scope(strategy, task.model.variables)
    task.optimizer = task.build_optimizer()
    task.optimizer.build(task.model.trainable_variables)
    strategy_lib.check_variables_in_scope(strategy, task.optimizer.variables)
    task.updater = Updater(task.optimizer, loss_scaling=task.config.precision == "mixed_float16",
                           clip_norm=task.config.clip_norm)


def train(config, out=None) -> RunResult:
    """Runs one training job as `config` says; returns what it achieved."""
    previous_policy = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(config.precision)  # layers built from here on use it
    try:
        return _train(config, out or sys.stdout)
    except tf.errors.OpError as err:
        if config.strategy != "multi_worker_mirrored":
            raise
        raise collective_failure(err, parse_tf_config(os.environ.get("TF_CONFIG"))) from None
    finally:
        keras.mixed_precision.set_dtype_policy(previous_policy)


def _train(config, out) -> RunResult:
    started = time.perf_counter()
    config_changes = run_record.check_resume(config)  # before anything is built or written
    placement = strategy_lib.build_strategy(config.strategy, config.cpu_replicas, config.collective_timeout)
    strategy = placement.strategy
    if placement.is_chief:
        run_record.create_model_dir(config.model_dir)
    per_replica = strategy_lib.per_replica_batch(config.global_batch, placement.num_replicas,
                                                 config.grad_accum_steps)
    seed = config.seed if config.seed is not None else random.randrange(2**31)
    cluster = placement.cluster
    if cluster is not None:
        if config.num_workers and config.num_workers != cluster.num_workers:
            raise UserError(f"--num_workers={config.num_workers} but TF_CONFIG lists {cluster.num_workers} workers")
        agreement_start = time.perf_counter()
        seed = agree(strategy, config, cluster, seed)
        out.write(f"agreement    all {cluster.num_workers} workers run the same flags "
                  f"(checked in {time.perf_counter() - agreement_start:.3f} s)\n")
    keras.utils.set_random_seed(seed)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()

    data = data_lib.load(config)
    steps_per_epoch = data_lib.steps_per_epoch(data, config.global_batch)
    schedule = Schedule(
        total_steps=config.train_steps or config.epochs * steps_per_epoch,
        steps_per_epoch=steps_per_epoch,
        steps_per_loop=config.steps_per_loop,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        histogram_every=config.histogram_every,
        marks=parse_profile_steps(config.profile_steps) or (),
    )
    task = load_task_class(config.task)(config, input_shape=data.image_shape, num_classes=data.num_classes)
    task.total_steps = schedule.total_steps

    with strategy.scope():
        build_task(strategy, task)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch",
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        seed_variable = tf.Variable(seed, dtype=tf.int64, trainable=False, name="seed",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    task.global_step = global_step

    checkpointer = Checkpointer(
        config.model_dir, placement.is_chief, config.keep_checkpoints,
        model=task.model, optimizer=task.optimizer, global_step=global_step, epoch=epoch, seed=seed_variable,
        **task.updater.checkpoint_items(),
        # Dropout & co.: a resumed run continues their random streams instead of restarting them.
        random_states=[generator.state.value for generator in seed_generators(task.model)],
    )
    configured_rate = constant_rate(task.optimizer)
    checkpoint_path = checkpointer.restore_latest()
    if configured_rate is not None:  # this run's --learning_rate, not the one the checkpoint holds
        task.optimizer.learning_rate = configured_rate
    start_step = int(global_step.numpy())
    if int(seed_variable.numpy()) != seed:  # a resumed run keeps its seed, so its data order
        seed = int(seed_variable.numpy())
        keras.utils.set_random_seed(seed)  # other randomness (initialisers, dropout) follows it too
    task.seed = seed
    _banner(config, placement, data, per_replica, schedule, seed, task.model, start_step, out)

    run_facts = {"engine_version": __version__, "replicas": placement.num_replicas, "effective_seed": seed}
    if placement.is_chief and (start_step == 0 or config_changes):
        run_record.write(config, run_facts)
    writers = create_writers(config.model_dir, placement.is_chief)
    monitor = Monitor(config, writers, task, data, is_chief=placement.is_chief)
    if start_step == 0:
        monitor.at_start(_config_markdown(config, run_facts), run_facts)
    train_data = data_lib.distributed_train_data(strategy, data, config, seed, skip_batches=start_step)
    eval_data = strategy.experimental_distribute_dataset(
        data_lib.eval_dataset(data.test_images, data.test_labels, config.global_batch)
    )
    histograms = config.histogram_every > 0
    train_loop = make_train_loop(strategy, task, global_step, accum_steps=config.grad_accum_steps,
                                 jit_compile=config.jit_compile,
                                 skip_nonfinite=config.on_nonfinite == "skip",
                                 grad_norm=config.summaries == "full", gradients=histograms)
    eval_loop = make_eval_loop(strategy, task)
    progress = Progress(schedule.total_steps, steps_per_epoch, start_step, stream=out,
                        enabled=placement.is_chief)

    def evaluate(at_step):
        metrics = ratios(eval_loop(eval_data))
        writers["eval"].write_scalars(at_step, metrics)
        monitor.after_eval(at_step)
        writers["eval"].flush()
        progress.message(
            f"eval   step {at_step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            + f"  ({len(data.test_images)} examples)"
        )
        return metrics

    def save(at_step):
        nonlocal saved_step
        epoch.assign(schedule.epoch(at_step))
        path = checkpointer.save(at_step)
        saved_step = at_step
        return path if placement.is_chief else None

    step = saved_step = start_step
    iterator = iter(train_data)
    eval_metrics, train_metrics = {}, {}
    trained_examples, training_seconds, first_loop_seconds, skipped_steps = 0, 0.0, None, 0
    peers = PeerWatchdog(cluster, config.collective_timeout) if cluster else None
    try:
        if peers:
            peers.start()
        with Watch(strategy, placement.num_workers) as watch:
            if step >= schedule.total_steps:
                progress.message(f"model_dir already holds step {step} of {schedule.total_steps}: nothing to train")
            while step < schedule.total_steps:
                if step > start_step and watch.stop_requested():  # at a loop boundary, on every worker
                    if saved_step != step:
                        checkpoint_path = save(step) or checkpoint_path
                    raise Preempted(
                        f"{watch.signal_name or 'a signal to another worker'} at step {step}: checkpoint "
                        f"{checkpoint_path or 'saved by the chief'}; rerun the same command to resume "
                        "(a second signal ends the run at once)")
                num_steps = schedule.next_loop_steps(step)
                first_call = first_loop_seconds is None
                monitor.before_loop(step, first_call)
                loop_start = time.perf_counter()
                result = train_loop(iterator, tf.constant(num_steps, dtype=tf.int32))
                seconds = time.perf_counter() - loop_start
                ran, bad = int(result["steps"].numpy()), int(result["bad_steps"].numpy())
                if config.on_nonfinite == "stop" and bad:
                    raise NonFiniteLoss(
                        f"non-finite loss or gradient at step {step + ran + 1} (NaN or Inf on at least one "
                        f"replica); nothing saved after step {saved_step}"
                        + (f" ({checkpoint_path})" if checkpoint_path else "")
                        + "; lower --learning_rate, check the data, or use --on_nonfinite=skip")
                train_metrics = ratios(result["totals"])
                if math.isnan(train_metrics.get("grad_norm", 0.0)):
                    del train_metrics["grad_norm"]  # nan: the Task applied no gradients via apply_gradients
                skipped_steps += bad
                if bad:
                    progress.message(f"skipped {bad} of steps {step + 1}-{step + num_steps}: non-finite loss "
                                     f"or gradient, weights and optimizer left as they were "
                                     f"({skipped_steps} skipped in this run)")
                step += num_steps
                if first_loop_seconds is None:
                    first_loop_seconds = time.perf_counter() - started
                else:  # the first loop includes tracing; leave it out of the throughput
                    trained_examples += num_steps * config.global_batch
                    training_seconds += seconds
                examples_per_sec = num_steps * config.global_batch / seconds
                writers["train"].write_scalars(step, {
                    **train_metrics,
                    **_update_scalars(task.updater, result),
                    "learning_rate": _scalar(task.optimizer.learning_rate),
                    "steps_per_sec": num_steps / seconds,
                    "examples_per_sec": examples_per_sec,
                    "loop_seconds": seconds,
                })
                monitor.after_loop(step, first_call, result.get("gradients"))
                progress.update(step, train_metrics, examples_per_sec)
                if schedule.eval_due(step):
                    eval_metrics = evaluate(step)
                if schedule.checkpoint_due(step):
                    checkpoint_path = save(step) or checkpoint_path
                    writers["train"].flush()
        if not eval_metrics:
            eval_metrics = evaluate(step)
        if peers:
            peers.stop()  # the last collective is done; a worker that exits now is not lost
        export_path = None
        if placement.is_chief and config.export:
            export_path = os.path.join(config.model_dir, "export", "model.keras")
            os.makedirs(os.path.dirname(export_path), exist_ok=True)
            task.model.save(export_path)
    finally:
        monitor.stop_profiler()
        if peers:
            peers.stop()
        for writer in writers.values():
            writer.close()
        checkpointer.close()

    wall = time.perf_counter() - started
    throughput = trained_examples / training_seconds if training_seconds else (
        (step - start_step) * config.global_batch / max(wall, 1e-9))
    result = RunResult(
        model_dir=config.model_dir, start_step=start_step, final_step=step, eval_metrics=eval_metrics,
        train_metrics=train_metrics, train_examples_per_sec=throughput, wall_seconds=wall,
        seconds_to_first_loop=first_loop_seconds or 0.0, export_path=export_path,
        checkpoint_path=checkpoint_path, skipped_steps=skipped_steps,
    )
    if placement.is_chief:
        _summary(result, out)
    return result


def _update_scalars(updater, result) -> dict:
    """Loss scale and updates skipped in the loop (overflows, bad steps), when loss scaling is on."""
    if not updater.loss_scaling:
        return {}
    return {"loss_scale": _scalar(updater.loss_scale),
            "skipped_updates": float(result["skipped_updates"].numpy())}


def _config_markdown(config, run_facts: dict) -> str:
    rows = [f"| {k.replace('_', ' ')} | {v} |" for k, v in run_facts.items()]
    rows += [f"| {k} | {v} |" for k, v in config.as_dict().items()]
    return "| flag | value |\n|---|---|\n" + "\n".join(rows)


def _summary(result: RunResult, out) -> None:
    shown = "  ".join(f"{k} {v:.4f}" for k, v in result.eval_metrics.items())
    logdir = os.path.abspath(result.model_dir)
    lines = [
        "",
        f"done   test {shown}",
        f"       wall time {format_duration(result.wall_seconds)}, steps {result.start_step} -> "
        f"{result.final_step}, {result.train_examples_per_sec:,.0f} train examples/s "
        f"(first loop, with tracing, finished {result.seconds_to_first_loop:.1f} s after start)",
        f"       checkpoint {result.checkpoint_path}",
    ]
    if result.export_path:
        lines.append(f"       exported model {result.export_path}")
    lines += [f"       TensorBoard logs in {logdir}", f"       watch: tensorboard --logdir {logdir}"]
    out.write("\n".join(lines) + "\n")
    out.flush()
