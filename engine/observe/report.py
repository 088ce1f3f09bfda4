"""What the chief prints: the banner before training and the summary after it (and the config
table TensorBoard shows). Text only; nothing here touches TensorFlow."""

from __future__ import annotations

import os

from engine.observe.progress import format_duration


def banner(config, placement, data, per_replica, schedule, seed, model, start_step, out, input_mode):
    lines = [
        f"strategy     {placement.name}: {placement.num_replicas} replica(s) in sync, this process on "
        f"{', '.join(placement.devices)}",
        *([f"cluster      {placement.cluster.describe()}"] if placement.cluster else []),
        f"global batch {config.global_batch} = {placement.num_replicas} "
        f"{'replica' if placement.num_replicas == 1 else 'replicas'} x {per_replica}"
        + (
            f" ({config.grad_accum_steps} micro-batches of {per_replica // config.grad_accum_steps} per replica, "
            "one update)"
            if config.grad_accum_steps > 1
            else ""
        ),
        f"update       {config.optimizer}, precision {config.precision}"
        + (f", clip global norm {config.clip_norm}" if config.clip_norm else "")
        + (f", weight decay {config.weight_decay}" if config.weight_decay else "")
        + (f", learning rate {config.lr_schedule}" if config.lr_schedule != "constant" else ""),
        f"data         {data.name}: {data.num_train} train / {data.num_test} test, "
        f"{data.spec.describe()}, from {data.where}",
        f"input        {data.sharding(placement.num_workers)}"
        + ("" if input_mode == "streamed" else f"; --input_mode {input_mode}"),
        f"model        {_model_name(config, model)} ({model.count_params():,} parameters), task {config.task}",
        f"schedule     {schedule.total_steps} steps ({schedule.total_steps / schedule.steps_per_epoch:.2f} "
        f"epochs of {schedule.steps_per_epoch}), {schedule.steps_per_loop} steps per compiled loop, "
        f"eval every {schedule.eval_interval or 'never (not in training)'}, "
        f"checkpoint every {schedule.checkpoint_interval}",
        f"seed         {seed}"
        + (
            " (the resumed run's)"
            if start_step
            else ""
            if config.seed is not None
            else f" (random; --seed={seed} repeats it)"
        ),
        f"model_dir    {config.model_dir}" + (f" (resuming at step {start_step})" if start_step else ""),
    ]
    if placement.name == "mirrored" and placement.num_replicas == 1:
        lines.append(
            "note         mirrored found a single device: this run is not distributed "
            "(use --cpu_replicas=N to split the CPU into N replicas)"
        )
    if config.run_eagerly:
        lines.append(
            "note         --run_eagerly: train_step and eval_step run as plain Python, op by op (print, pdb and "
            ".numpy() work); a debugging mode, many times slower than the compiled loop"
        )
    if config.precision == "mixed_float16" and not any("GPU" in device.upper() for device in placement.devices):
        lines.append(
            "note         mixed_float16 on a CPU: no fast float16 kernels here, so it trains many times slower "
            "than float32 (measured: docs/performance.md#bfloat16-and-xla-on-a-cpu); --precision=mixed_bfloat16 "
            "needs no loss scaling and is fast on CPUs"
        )
    out.write("\n".join(lines) + "\n")
    out.flush()


def config_markdown(config, run_facts: dict) -> str:
    rows = [f"| {k.replace('_', ' ')} | {v} |" for k, v in run_facts.items()]
    rows += [f"| {k} | {v} |" for k, v in config.as_dict().items()]
    return "| flag | value |\n|---|---|\n" + "\n".join(rows)


def summary(result, out) -> None:
    shown = (
        "test " + "  ".join(f"{k} {v:.4f}" for k, v in result.eval_metrics.items())
        if result.eval_metrics
        else "training (not evaluated here: an evaluator job or --mode=eval evaluates its checkpoints)"
    )
    logdir = os.path.abspath(result.model_dir)
    lines = [
        "",
        f"done   {shown}",
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


def _model_name(config, model) -> str:
    """--model, or the name of the model a Task built itself (e.g. language_model's byte_transformer)."""
    return config.model if model.name == config.model else f"{model.name} (the Task's build_model)"
