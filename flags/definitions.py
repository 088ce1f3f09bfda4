"""Every flag of run.py, with its meaning and units, and the checks across flags."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re

from absl import flags as absl_flags

from engine.errors import UserError
from engine.config import INPUT_MODES, LR_SCHEDULES, METRIC_DIRECTIONS, MODES, PRECISIONS, STRATEGIES, Config

OPTIMIZERS = ("adam", "sgd")
NONFINITE_ACTIONS = ("stop", "skip", "rollback")

# The headings of docs/flags.md (flags/reference.py): (heading, the first flag under it), in the
# order define_flags declares them.
SECTIONS = (
    ("What this process does", "mode"),
    ("Distribution", "strategy"),
    ("Data", "dataset"),
    ("Model, task, optimizer", "model"),
    ("Schedule", "global_batch"),
    ("Output", "model_dir"),
    ("TensorBoard extras", "summaries"),
    ("Reproducibility and compilation", "seed"),
)


def default_model_dir(dataset: str, model: str, strategy: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind, _, argument = dataset.partition(":")  # npz:/data/x.npz -> npz_x
    name = f"{kind}_{os.path.splitext(os.path.basename(argument.split(',')[0].rstrip('/')))[0]}" if argument else kind
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return os.path.join("runs", f"{name}-{_model_name(model)}-{strategy}-{stamp}")


def _model_name(model: str) -> str:
    """--model as one path component: path/to/net.py:build -> net_build, keras.applications.ResNet50
    -> ResNet50, cnn -> cnn."""
    where, _, function = model.rpartition(":")
    if where:
        module = os.path.splitext(os.path.basename(where))[0] if where.endswith(".py") else where.rpartition(".")[2]
        model = f"{module}_{function}"
    elif model.startswith("keras.applications."):
        model = model[len("keras.applications.") :]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model)


def define_flags(flag_values: absl_flags.FlagValues = absl_flags.FLAGS) -> None:
    """Declares the flags on `flag_values` (absl's global FLAGS by default). Call once."""
    f = dict(flag_values=flag_values)
    # What this process does.
    absl_flags.DEFINE_enum(
        "mode",
        "train",
        MODES,
        "train: train (and evaluate as --eval_every says); eval: evaluate the latest checkpoint of "
        "--model_dir (or --checkpoint) on the test split once, write the metrics to its eval/ run at the "
        "checkpoint's step, exit; continuous_eval: evaluate each new checkpoint of --model_dir once, until "
        "the run's last step or --eval_timeout seconds without a new one (a TF_CONFIG task of type "
        "evaluator always runs this).",
        **f,
    )
    absl_flags.DEFINE_string(
        "checkpoint",
        "",
        "--mode=eval: the checkpoint to evaluate, a path prefix such as RUN/checkpoints/ckpt-600 (its "
        "--model_dir still gives config.json and the eval/ run); empty: the latest one of --model_dir.",
        **f,
    )
    absl_flags.DEFINE_float(
        "eval_timeout",
        3600.0,
        "--mode=continuous_eval (and the evaluator task): seconds to wait for the run's config.json, for "
        "its first checkpoint and for each new one before stopping (--mode=eval does not wait).",
        **f,
    )
    absl_flags.register_validator(
        "eval_timeout",
        lambda value: math.isfinite(value) and value > 0,
        message="--eval_timeout must be a finite number of seconds > 0",
        flag_values=flag_values,
    )
    absl_flags.DEFINE_string(
        "best_metric",
        "",
        "Keep the best checkpoint by this eval metric in <model_dir>/best/ (checkpoint, model.keras, "
        "best.json with step and value), updated by whichever process evaluates: "
        + ", ".join(
            f"{name} ({'higher' if sign == '+' else 'lower'} is better)" for name, sign in METRIC_DIRECTIONS.items()
        )
        + "; any other eval metric with its direction: +NAME (higher is better) or -NAME (lower); "
        "empty: off.",
        **f,
    )
    absl_flags.register_validator(
        "best_metric",
        _valid_best_metric,
        message="--best_metric must be accuracy, loss, +NAME (higher is better) or -NAME (lower is better)",
        flag_values=flag_values,
    )
    absl_flags.DEFINE_boolean(
        "evaluator",
        False,
        "With --num_workers=N and no TF_CONFIG: also start one local evaluator process (TF_CONFIG task "
        "type evaluator) that evaluates each checkpoint beside the workers; the workers then skip "
        "in-training evaluation.",
        **f,
    )
    # Distribution.
    absl_flags.DEFINE_enum(
        "strategy",
        "default",
        STRATEGIES,
        "How to distribute: default (no distribution), one_device (first GPU, else CPU), "
        "mirrored (all local GPUs, or --cpu_replicas CPU devices), multi_worker_mirrored (TF_CONFIG).",
        **f,
    )
    absl_flags.DEFINE_integer(
        "cpu_replicas",
        1,
        "Split the host CPU into this many logical devices (replicas for --strategy=mirrored "
        "on a machine without GPUs).",
        lower_bound=1,
        upper_bound=64,
        **f,
    )
    absl_flags.DEFINE_float(
        "collective_timeout",
        300.0,
        "Seconds before a missing multi-worker peer is an error, not a hang: at start-up (the "
        "cluster must form) and while training (a worker whose port stays unreachable).",
        lower_bound=1.0,
        **f,
    )
    absl_flags.DEFINE_integer(
        "num_workers",
        0,
        "With --strategy=multi_worker_mirrored and no TF_CONFIG: start this many local worker "
        "processes on 127.0.0.1 (free ports, one TF_CONFIG each). With TF_CONFIG: must match its "
        "cluster size (0: not checked).",
        lower_bound=0,
        upper_bound=64,
        **f,
    )
    absl_flags.DEFINE_integer(
        "max_restarts",
        0,
        "With --num_workers (the local launcher): when a worker fails with a code a restart "
        "may cure (>= 128: preempted, peer lost, stalled, ...; or killed by a signal), stop the others and "
        "start the whole cluster again on fresh ports, resuming from the last checkpoint, up to this many "
        "times. Permanent failures (1, 2, 4) are never retried.",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_float(
        "stall_timeout",
        600.0,
        "Seconds without a completed training step (or evaluation batch) after which "
        "a worker writes every thread's stack to <model_dir>/stalls/, names the worker(s) that stopped, and "
        "exits 151 (stalled). Must exceed the longest loop (--steps_per_loop steps); 0: off.",
        lower_bound=0.0,
        **f,
    )
    absl_flags.DEFINE_enum(
        "input_mode",
        "auto",
        INPUT_MODES,
        "How an in-memory source's training data reaches the replicas (streamed sources build "
        "one pipeline per worker unless resident): auto (resident, or distribute_dataset when the Task augments "
        "each example), distribute_dataset (one pipeline of global batches, split by "
        "strategy.experimental_distribute_dataset), per_worker (each worker "
        "builds its own pipeline of per-replica batches, strategy.distribute_datasets_from_function) "
        "or resident (the training arrays in every replica's device memory, "
        "each batch gathered inside the compiled loop; the same batches, no tf.data; a streamed source "
        "(tfrecord:, images:, tfds:) is then read and decoded whole at start-up, up to 1 GiB, and "
        "drawn in the order of in-memory data).",
        **f,
    )
    # Data.
    absl_flags.DEFINE_string(
        "dataset",
        "mnist",
        "Training data: mnist (mnist.npz or IDX files), fashion_mnist (IDX files), synthetic "
        "(generated, learnable; no files needed); npz:PATH (arrays x_train, y_train, x_test, y_test of "
        "any shape, in memory); tfrecord:TRAIN_GLOB[,TEST_GLOB] (tf.train.Example shards, streamed); "
        "images:DIR (JPEG/PNG files in class folders DIR/train/<class>/ and DIR/test/<class>/, or "
        "DIR/<class>/ with --validation_split; streamed); tfds:NAME[:CONFIG] (a TensorFlow Datasets builder "
        'already prepared under --data_dir, streamed; pip install -e ".[tfds]"); text:PATH (UTF-8 text: a file, '
        "a directory or a glob of files, as --seq_len byte tokens and their next bytes; in memory).",
        **f,
    )
    absl_flags.DEFINE_string(
        "data_dir",
        None,
        "Directory with local data files: mnist.npz or the 4 IDX files (train-images-idx3-ubyte.gz, "
        "...); for tfds:NAME the TFDS data directory holding NAME/[CONFIG/]VERSION. Default: the Keras cache "
        "(~/.keras/datasets), for fashion_mnist /usr/share/datasets/fashion-mnist, then the Keras download; "
        "for tfds: TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets).",
        **f,
    )
    absl_flags.DEFINE_integer(
        "synthetic_train_examples", 60000, "Training examples of --dataset=synthetic.", lower_bound=1, **f
    )
    absl_flags.DEFINE_integer(
        "synthetic_test_examples", 10000, "Test examples of --dataset=synthetic.", lower_bound=1, **f
    )
    absl_flags.DEFINE_string(
        "synthetic_shape",
        "28,28",
        "Shape of one --dataset=synthetic example, comma-separated: 28,28 (grey images), 32,32,3 "
        "(colour), 64 (feature vectors).",
        **f,
    )
    absl_flags.DEFINE_integer(
        "num_classes",
        0,
        "Number of classes; 0: from the data (its largest label + 1). Labels must lie in [0, num_classes).",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_integer(
        "shuffle_buffer",
        10000,
        "Examples held in the shuffle buffer of streamed sources (tfrecord:, images:, tfds:); "
        "in-memory sources shuffle whole epochs.",
        lower_bound=1,
        **f,
    )
    absl_flags.DEFINE_boolean(
        "cache",
        False,
        "Streamed sources (tfrecord:, images:, tfds:): keep the raw records in memory after the "
        "first pass (file order then fixed, the shuffle buffer still shuffles). Refused where it would do "
        "nothing: data held in memory, --input_mode=resident, a Task's own pipelines.",
        **f,
    )
    absl_flags.DEFINE_string(
        "image_size",
        "",
        "--dataset=images:DIR (or tfrecord: records of encoded images): HEIGHT,WIDTH in pixels to resize "
        "every image to (bilinear), e.g. 64,64; empty: keep the files' own size, which all of them must "
        "share.",
        **f,
    )
    absl_flags.DEFINE_float(
        "validation_split",
        0.0,
        "--dataset=images:DIR holding class folders without train/ and test/: the fraction (0 < F < 1) of "
        "each class held out as the test split, chosen by a hash of each file's path (the same on every "
        "worker and resume); 0: DIR/train and DIR/test give the splits.",
        **f,
    )
    absl_flags.register_validator(
        "validation_split",
        lambda value: 0 <= value < 1,
        message="--validation_split must be a fraction with 0 < F < 1 (0: use DIR/train and DIR/test)",
        flag_values=flag_values,
    )
    absl_flags.DEFINE_integer(
        "seq_len",
        128,
        "--dataset=text:PATH: tokens (bytes) per example; each example is seq_len input bytes "
        "and the seq_len bytes that follow each of them.",
        lower_bound=1,
        **f,
    )
    # Model, task, optimizer.
    absl_flags.DEFINE_string(
        "model",
        "cnn",
        "The network, in one of three forms: a registered name (engine/models/registry.py): cnn (the Keras "
        "MNIST example's CNN), cnn_bn (2 conv blocks, batch norm synchronised across replicas, dropout: "
        "0.91-0.92 on fashion_mnist), mlp, resnet20 (the CIFAR ResNet-20, 0.27 M parameters); "
        "package.module:function or path/to/file.py:function (a function (input_shape, num_classes) "
        "returning a keras.Model that outputs logits); or keras.applications.NAME (e.g. ResNet50, "
        "MobileNetV2, EfficientNetB0: untrained, for the data's shape and classes, logits out).",
        **f,
    )
    absl_flags.DEFINE_string(
        "task",
        "classification",
        "The step functions: a registered name (classification; label_smoothing, the worked example in "
        "engine/tasks/label_smoothing.py; language_model, the byte-level Transformer for --dataset=text:PATH), "
        "package.module:Class or "
        "path/to/file.py:Class (a subclass of engine.task.Task).",
        **f,
    )
    absl_flags.DEFINE_enum(
        "optimizer",
        "adam",
        OPTIMIZERS,
        "The Keras optimizer of the model (engine/optimizers.py): adam (AdamW with --weight_decay) or "
        "sgd (plain, no momentum).",
        **f,
    )
    absl_flags.DEFINE_float(
        "learning_rate",
        None,
        "Learning rate (per optimizer update), a finite number > 0. Default: 0.001 for adam, 0.05 for sgd.",
        **f,
    )
    absl_flags.register_validator(
        "learning_rate",
        lambda rate: rate is None or (math.isfinite(rate) and rate > 0),
        message="--learning_rate must be a finite number > 0",
        flag_values=flag_values,
    )
    absl_flags.DEFINE_enum(
        "lr_schedule",
        "constant",
        LR_SCHEDULES,
        "Learning rate over the run's optimizer updates: constant; cosine (from --learning_rate down "
        "to 0 at the last step); warmup_cosine (linear from 0 to --learning_rate over --warmup_steps, "
        "then cosine to 0).",
        **f,
    )
    absl_flags.DEFINE_integer(
        "warmup_steps",
        0,
        "Optimizer updates of linear warm-up for --lr_schedule=warmup_cosine "
        "(needs > 0 there, and fewer than the run's steps).",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_float(
        "weight_decay",
        0.0,
        "Decoupled weight decay per update: w -= learning_rate x weight_decay x w (with adam this is "
        "AdamW); biases and batch-norm scales/offsets are not decayed; 0: off.",
        lower_bound=0.0,
        **f,
    )
    absl_flags.DEFINE_float(
        "clip_norm",
        0.0,
        "Clip the global L2 norm of the gradient to this value, computed on the gradient summed over "
        "all replicas and workers (after loss unscaling); 0: off.",
        lower_bound=0.0,
        **f,
    )
    absl_flags.DEFINE_enum(
        "precision",
        "float32",
        PRECISIONS,
        "float32; mixed_bfloat16 (bfloat16 compute, float32 weights, no loss scaling); mixed_float16 "
        "(float16 compute, dynamic loss scaling whose overflow check covers every replica and worker). "
        "The model's last layer stays float32.",
        **f,
    )
    absl_flags.DEFINE_integer(
        "grad_accum_steps",
        1,
        "Split each global batch into this many micro-batches, run one after another on each replica; "
        "their gradients are summed before the one optimizer update (same update, about 1/K of the "
        "activation memory). --global_batch must divide by replicas x this.",
        lower_bound=1,
        **f,
    )
    for name in ("weight_decay", "clip_norm"):
        absl_flags.register_validator(
            name,
            lambda value: math.isfinite(value),
            message=f"--{name} must be a finite number >= 0",
            flag_values=flag_values,
        )
    # Schedule.
    absl_flags.DEFINE_integer(
        "global_batch",
        256,
        "Examples per step across ALL replicas and workers; each replica gets global_batch / "
        "replicas, which must divide evenly.",
        lower_bound=1,
        **f,
    )
    absl_flags.DEFINE_integer(
        "epochs", 3, "Passes over the training set (ignored when --train_steps is set).", lower_bound=1, **f
    )
    absl_flags.DEFINE_integer(
        "train_steps", 0, "Total training steps (global batches); > 0 wins over --epochs.", lower_bound=0, **f
    )
    absl_flags.DEFINE_integer(
        "steps_per_loop",
        100,
        "Steps run inside one compiled tf.function call; logging, progress and checkpoints happen between loops.",
        lower_bound=1,
        **f,
    )
    absl_flags.DEFINE_integer(
        "eval_every",
        0,
        "Evaluate on the whole test set every this many steps; 0: at each epoch end. "
        "Always also at the end. -1: never during training (a sidecar evaluator or --mode=eval does it; "
        "the default with a TF_CONFIG evaluator task).",
        lower_bound=-1,
        **f,
    )
    absl_flags.DEFINE_integer(
        "checkpoint_every",
        0,
        "Save a checkpoint every this many steps; 0: at each epoch end. Always also at the end.",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_integer(
        "keep_checkpoints",
        3,
        "How many recent checkpoints of checkpoints/ to keep (older ones are deleted; best/ is separate).",
        lower_bound=1,
        **f,
    )
    absl_flags.DEFINE_float(
        "ema_decay",
        0.0,
        "Keep an exponential moving average of the weights with this decay per update "
        "(e.g. 0.999; warm-up min(decay, (1+t)/(10+t)) over t updates); evaluated next to the trained weights "
        "(eval_ema/), and used by --best_metric, early stopping and the export. 0: off.",
        lower_bound=0.0,
        upper_bound=0.999999,
        **f,
    )
    absl_flags.DEFINE_integer(
        "early_stopping_patience",
        0,
        "End training (exit 0, final checkpoint) after this many evaluations in a "
        "row without an improvement of --best_metric by at least --early_stopping_min_delta. 0: off.",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_float(
        "early_stopping_min_delta",
        0.0,
        "The least improvement of --best_metric (in its own units, e.g. 0.001 "
        "accuracy) that resets --early_stopping_patience.",
        lower_bound=0.0,
        **f,
    )
    absl_flags.DEFINE_enum(
        "on_nonfinite",
        "stop",
        NONFINITE_ACTIONS,
        "A NaN or Inf loss or gradient (any replica), or a loss above --loss_upper_bound: stop (end the run "
        "naming the step, exit 4, no checkpoint of the bad weights), skip (the step leaves weights and optimizer "
        "untouched) or rollback (restore the last checkpoint, move the data past the bad step, go on; "
        "--max_rollbacks times at most, then stop).",
        **f,
    )
    absl_flags.DEFINE_integer(
        "max_rollbacks",
        3,
        "--on_nonfinite=rollback: rollbacks a run may make; the next bad step stops it (exit 4). 0: stop at the first.",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_float(
        "loss_upper_bound",
        0.0,
        "A step whose training loss (the reduced `loss` metric) exceeds this counts as "
        "bad, like a non-finite one (a loss spike); with --on_nonfinite=stop or rollback. 0: off.",
        lower_bound=0.0,
        **f,
    )
    # Output.
    absl_flags.DEFINE_string(
        "model_dir",
        None,
        "Directory for TensorBoard logs (train/, eval/), checkpoints (checkpoints/) and the exported "
        "model (export/model.keras). A directory holding a run resumes it from its latest "
        "checkpoint. Default: runs/<dataset>-<model>-<strategy>-<YYYYmmdd-HHMMSS> (a new run).",
        **f,
    )
    absl_flags.DEFINE_boolean(
        "export",
        True,
        "Export the trained model at the end in --export_formats (chief only); --noexport skips it.",
        **f,
    )
    absl_flags.DEFINE_string(
        "export_formats",
        "keras",
        "Comma-separated: keras (<model_dir>/export/model.keras, "
        "keras.models.load_model) and/or saved_model (<model_dir>/export/saved_model/<step>/, a serving "
        "signature on the data's raw examples: docs/serving.md).",
        **f,
    )
    absl_flags.register_validator(
        "export_formats",
        lambda text: all(p.strip() in ("keras", "saved_model") for p in text.split(",")) and bool(text.strip()),
        message="use keras, saved_model or keras,saved_model",
        flag_values=flag_values,
    )
    absl_flags.DEFINE_boolean(
        "allow_config_change",
        False,
        "Resume a --model_dir even though --model, --dataset, --global_batch, --task, --optimizer, "
        "--lr_schedule, --precision, --image_size, --validation_split, --seq_len or the data's class names differ "
        "from its config.json (the checkpoint must still match).",
        **f,
    )
    # TensorBoard extras.
    absl_flags.DEFINE_enum(
        "summaries",
        "full",
        ("full", "basic"),
        "full: loop scalars + global gradient norm, sample-input, confusion-matrix and misclassified "
        "images, HParams; basic: loop scalars and the config text only.",
        **f,
    )
    absl_flags.DEFINE_integer(
        "histogram_every",
        0,
        "Write weight and gradient histograms every this many steps (loops are cut to land on them); 0: off.",
        lower_bound=0,
        **f,
    )
    absl_flags.DEFINE_boolean(
        "trace_graph", False, "Write the traced train loop graph for the Graphs tab (first loop only).", **f
    )
    absl_flags.DEFINE_string(
        "profile_steps",
        "",
        "START,END: capture a profiler trace of steps START+1..END (Profile tab; needs "
        "the `profile` extra to view); empty: off.",
        **f,
    )
    # Reproducibility and compilation.
    absl_flags.DEFINE_integer(
        "seed", None, "Seed for weights and data order; default: random (printed, so it can be reused).", **f
    )
    absl_flags.DEFINE_boolean(
        "deterministic",
        False,
        "Deterministic TensorFlow ops (slower); with --seed, runs repeat bitwise on one replica.",
        **f,
    )
    absl_flags.DEFINE_boolean(
        "jit_compile",
        False,
        "Compile the step with XLA. Off by default: about 3x slower for the CNN on CPU. "
        "Refused with synchronised batch norm (cnn_bn) under mirrored strategies.",
        **f,
    )


def _valid_best_metric(text: str) -> bool:
    if text in ("", *METRIC_DIRECTIONS):
        return True
    return bool(re.fullmatch(r"[+-][A-Za-z_][A-Za-z0-9_./]*", text))


def config_from_flags(flag_values: absl_flags.FlagValues = absl_flags.FLAGS) -> Config:
    """The parsed flags as a frozen Config (after absl has validated each flag)."""
    v = flag_values
    model_dir = v.model_dir or default_model_dir(v.dataset, v.model, v.strategy)
    if v.checkpoint and v.mode != "eval":
        raise UserError(
            f"--checkpoint={v.checkpoint} needs --mode=eval "
            "(training and continuous_eval use --model_dir's checkpoints)"
        )
    if v.evaluator and not (v.num_workers and v.strategy == "multi_worker_mirrored"):
        raise UserError(
            "--evaluator needs --strategy=multi_worker_mirrored --num_workers=N (the local launcher); on a "
            "cluster give TF_CONFIG an 'evaluator' task instead"
        )
    if v.max_restarts and not v.num_workers:
        raise UserError(
            f"--max_restarts={v.max_restarts} needs --num_workers=N (the local launcher restarts its "
            "workers); on a cluster the cluster manager restarts them: see deploy/ and docs/strategies.md"
        )
    values = {field.name: getattr(v, field.name) for field in dataclasses.fields(Config)}
    return Config(**{**values, "model_dir": model_dir})
