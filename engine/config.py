"""The frozen run configuration, and the one home of every flag's default, type, bounds and help.

flags/ declares one absl flag per field of `Config` from its metadata (`_option`) and builds the
Config back from the parsed flags; tests build it directly. No TensorFlow import here: --help and
the flag checks run before TensorFlow loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from typing import Optional

from engine import exit_codes

# The names the engine accepts, in one place.
STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored")
# Built-in names; also npz:PATH, tfrecord:GLOB[,GLOB], images:DIR, tfds:NAME[:CONFIG], text:PATH.
DATASETS = ("mnist", "fashion_mnist", "synthetic")
INPUT_MODES = ("auto", "distribute_dataset", "per_worker", "resident")
OPTIMIZERS = ("adam", "sgd")  # engine/optimizers.py builds them (tests/test_flags.py checks both agree)
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
LR_SCHEDULES = ("constant", "cosine", "warmup_cosine")
MODES = ("train", "eval", "continuous_eval")
NONFINITE_ACTIONS = ("stop", "skip", "rollback")
SUMMARIES = ("full", "basic")
EXPORT_FORMATS = ("keras", "saved_model")
# --best_metric without a sign: the direction of the known metric names (+: higher is better).
METRIC_DIRECTIONS = {"accuracy": "+", "loss": "-"}


def resolved_input_mode(config, source, augmented: bool) -> str:
    """The input mode a run uses: "streamed" for sources read from files (always one pipeline per
    worker), else --input_mode, auto being resident (the arrays are in memory already; no tf.data
    work per step) unless the Task augments each example (`augmented`): then distribute_dataset,
    whose parallel, prefetched pipeline augments beside the step instead of inside it."""
    if source.streamed:
        return "streamed"
    if config.input_mode == "auto":
        return "distribute_dataset" if augmented else "resident"
    return config.input_mode


def default_model_dir(dataset: str, model: str, strategy: str) -> str:
    """runs/<dataset>-<model>-<strategy>-<YYYYmmdd-HHMMSS>: a new run's directory."""
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


def export_format_list(text: str):
    """--export_formats as a tuple of EXPORT_FORMATS; None when it names another one, or none."""
    formats = tuple(part.strip() for part in text.split(",") if part.strip())
    return formats if formats and all(f in EXPORT_FORMATS for f in formats) else None


def _option(default, help: str, *, choices=None, lower=None, upper=None):
    """A Config field that is also a flag: its default (the only place it is written), its help
    (meaning and units), and the bounds or choices the flag enforces."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "lower": lower, "upper": upper}
    )


def _code(code: exit_codes.ExitCode) -> str:
    return f"exit {code.code}, {code.name}"


@dataclasses.dataclass(frozen=True)
class Config:
    # What this process does.
    mode: str = _option(
        "train",
        "train: train (and evaluate as --eval_every says); eval: evaluate the latest checkpoint of "
        "--model_dir (or --checkpoint) on the test split once, write the metrics to its eval/ run at the "
        "checkpoint's step, exit; continuous_eval: evaluate each new checkpoint of --model_dir once, until "
        "the run's last step or --eval_timeout seconds without a new one (a TF_CONFIG task of type evaluator "
        "always runs this).",
        choices=MODES,
    )
    checkpoint: str = _option(
        "",
        "--mode=eval: the checkpoint to evaluate, a path prefix such as RUN/checkpoints/ckpt-600 (its "
        "--model_dir still gives config.json and the eval/ run); empty: the latest one of --model_dir.",
    )
    eval_timeout: float = _option(
        3600.0,
        "--mode=continuous_eval (and the evaluator task): seconds to wait for the run's config.json, for its "
        "first checkpoint and for each new one before stopping (--mode=eval does not wait).",
    )
    best_metric: str = _option(
        "",
        "Keep the best checkpoint by this eval metric in <model_dir>/best/ (checkpoint, model.keras, best.json "
        "with step and value), updated by whichever process evaluates: "
        + ", ".join(
            f"{name} ({'higher' if sign == '+' else 'lower'} is better)" for name, sign in METRIC_DIRECTIONS.items()
        )
        + "; any other eval metric with its direction: +NAME (higher is better) or -NAME (lower); empty: off.",
    )
    evaluator: bool = _option(
        False,
        "With --num_workers=N and no TF_CONFIG: also start one local evaluator process (TF_CONFIG task type "
        "evaluator) that evaluates each checkpoint beside the workers; the workers then skip in-training "
        "evaluation.",
    )
    # Distribution.
    strategy: str = _option(
        "default",
        "How to distribute: default (no distribution), one_device (first GPU, else CPU), mirrored (all local "
        "GPUs, or --cpu_replicas CPU devices), multi_worker_mirrored (TF_CONFIG).",
        choices=STRATEGIES,
    )
    cpu_replicas: int = _option(
        1,
        "Split the host CPU into this many logical devices (replicas for --strategy=mirrored on a machine "
        "without GPUs).",
        lower=1,
        upper=64,
    )
    collective_timeout: float = _option(
        300.0,
        "Seconds before a missing multi-worker peer is an error, not a hang: at start-up (the cluster must "
        "form) and while training (a worker whose port stays unreachable).",
        lower=1.0,
    )
    num_workers: int = _option(
        0,
        "With --strategy=multi_worker_mirrored and no TF_CONFIG: start this many local worker processes on "
        "127.0.0.1 (free ports, one TF_CONFIG each). With TF_CONFIG: must match its cluster size (0: not "
        "checked).",
        lower=0,
        upper=64,
    )
    max_restarts: int = _option(
        0,
        "With --num_workers (the local launcher): when a worker fails with a code a restart may cure (>= 128: "
        "preempted, peer lost, stalled, ...; or killed by a signal), stop the others and start the whole "
        "cluster again on fresh ports, resuming from the last checkpoint, up to this many times. Permanent "
        f"failures ({', '.join(map(str, exit_codes.PERMANENT))}) are never retried.",
        lower=0,
    )
    stall_timeout: float = _option(
        600.0,
        "Seconds without a completed training step (or evaluation batch) after which a worker writes every "
        "thread's stack to <model_dir>/stalls/, names the worker(s) that stopped, and ends the run "
        f"({_code(exit_codes.STALLED)}). "
        "Must exceed the longest loop (--steps_per_loop steps); 0: off.",
        lower=0.0,
    )
    input_mode: str = _option(
        "auto",
        "How an in-memory source's training data reaches the replicas (streamed sources build one pipeline "
        "per worker unless resident): auto (resident, or distribute_dataset when the Task augments each "
        "example), distribute_dataset (one pipeline of global batches, split by "
        "strategy.experimental_distribute_dataset), per_worker (each worker builds its own pipeline of "
        "per-replica batches, strategy.distribute_datasets_from_function) or resident (the training arrays in "
        "every replica's device memory, each batch gathered inside the compiled loop; the same batches, no "
        "tf.data; a streamed source (tfrecord:, images:, tfds:) is then read and decoded whole at start-up, "
        "within the in-memory limit (docs/data.md#the-in-memory-limit), and drawn in the order of in-memory data).",
        choices=INPUT_MODES,
    )
    # Data.
    dataset: str = _option(
        "mnist",
        "Training data: mnist (mnist.npz or IDX files), fashion_mnist (IDX files), synthetic (generated, "
        "learnable; no files needed); npz:PATH (arrays x_train, y_train, x_test, y_test of any shape, in "
        "memory); tfrecord:TRAIN_GLOB[,TEST_GLOB] (tf.train.Example shards, streamed); images:DIR (JPEG/PNG "
        "files in class folders DIR/train/<class>/ and DIR/test/<class>/, or DIR/<class>/ with "
        "--validation_split; streamed); tfds:NAME[:CONFIG] (a TensorFlow Datasets builder already prepared "
        'under --data_dir, streamed; pip install -e ".[tfds]"); text:PATH (UTF-8 text: a file, a directory or '
        "a glob of files, as --seq_len byte tokens and their next bytes; in memory).",
    )
    data_dir: Optional[str] = _option(
        None,
        "Directory with local data files: mnist.npz or the 4 IDX files (train-images-idx3-ubyte.gz, ...); for "
        "tfds:NAME the TFDS data directory holding NAME/[CONFIG/]VERSION. Default: the Keras cache "
        "(~/.keras/datasets), for fashion_mnist /usr/share/datasets/fashion-mnist, then the Keras download; "
        "for tfds: TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets).",
    )
    synthetic_train_examples: int = _option(
        60000,
        "Training examples of --dataset=synthetic.",
        lower=1,
    )
    synthetic_test_examples: int = _option(
        10000,
        "Test examples of --dataset=synthetic.",
        lower=1,
    )
    synthetic_shape: str = _option(
        "28,28",
        "Shape of one --dataset=synthetic example, comma-separated: 28,28 (grey images), 32,32,3 (colour), 64 "
        "(feature vectors).",
    )
    num_classes: int = _option(
        0,
        "Number of classes; 0: from the data (its largest label + 1). Labels must lie in [0, num_classes).",
        lower=0,
    )
    shuffle_buffer: int = _option(
        10000,
        "Examples held in the shuffle buffer of streamed sources (tfrecord:, images:, tfds:); in-memory "
        "sources shuffle whole epochs.",
        lower=1,
    )
    cache: bool = _option(
        False,
        "Streamed sources (tfrecord:, images:, tfds:): keep the raw records in memory after the first pass "
        "(file order then fixed, the shuffle buffer still shuffles). Refused where it would do nothing: data "
        "held in memory, --input_mode=resident, a Task's own pipelines.",
    )
    image_size: str = _option(
        "",
        "--dataset=images:DIR (or tfrecord: records of encoded images): HEIGHT,WIDTH in pixels to resize "
        "every image to (bilinear), e.g. 64,64; empty: keep the files' own size, which all of them must "
        "share.",
    )
    validation_split: float = _option(
        0.0,
        "--dataset=images:DIR holding class folders without train/ and test/: the fraction (0 < F < 1) of "
        "each class held out as the test split, chosen by a hash of each file's path (the same on every "
        "worker and resume); 0: DIR/train and DIR/test give the splits.",
    )
    seq_len: int = _option(
        128,
        "--dataset=text:PATH: tokens (bytes) per example; each example is seq_len input bytes and the seq_len "
        "bytes that follow each of them.",
        lower=1,
    )
    # Model, task, optimizer.
    model: str = _option(
        "cnn",
        "The network, in one of three forms: a registered name (engine/models/registry.py): cnn (the Keras "
        "MNIST example's CNN), cnn_bn (2 conv blocks, batch norm synchronised across replicas, dropout), "
        "mlp, resnet20 (the CIFAR ResNet-20); "
        "package.module:function or path/to/file.py:function (a function (input_shape, num_classes) returning "
        "a keras.Model that outputs logits); or keras.applications.NAME (e.g. ResNet50, MobileNetV2, "
        "EfficientNetB0: untrained, for the data's shape and classes, logits out).",
    )
    task: str = _option(
        "classification",
        "The step functions: a registered name (classification; label_smoothing, the worked example in "
        "engine/tasks/label_smoothing.py; language_model, the byte-level Transformer for "
        "--dataset=text:PATH), package.module:Class or path/to/file.py:Class (a subclass of "
        "engine.task.Task).",
    )
    optimizer: str = _option(
        "adam",
        "The Keras optimizer of the model (engine/optimizers.py): adam (AdamW with --weight_decay) or sgd "
        "(plain, no momentum).",
        choices=OPTIMIZERS,
    )
    learning_rate: Optional[float] = _option(
        None,
        "Learning rate (per optimizer update), a finite number > 0. Default: 0.001 for adam, 0.05 for sgd.",
    )
    lr_schedule: str = _option(
        "constant",
        "Learning rate over the run's optimizer updates: constant; cosine (from --learning_rate down to 0 at "
        "the last step); warmup_cosine (linear from 0 to --learning_rate over --warmup_steps, then cosine to "
        "0).",
        choices=LR_SCHEDULES,
    )
    warmup_steps: int = _option(
        0,
        "Optimizer updates of linear warm-up for --lr_schedule=warmup_cosine (needs > 0 there, and fewer than "
        "the run's steps).",
        lower=0,
    )
    weight_decay: float = _option(
        0.0,
        "Decoupled weight decay per update: w -= learning_rate x weight_decay x w (with adam this is AdamW); "
        "biases and batch-norm scales/offsets are not decayed; 0: off.",
        lower=0.0,
    )
    clip_norm: float = _option(
        0.0,
        "Clip the global L2 norm of the gradient to this value, computed on the gradient summed over all "
        "replicas and workers (after loss unscaling); 0: off.",
        lower=0.0,
    )
    precision: str = _option(
        "float32",
        "float32; mixed_bfloat16 (bfloat16 compute, float32 weights, no loss scaling); mixed_float16 (float16 "
        "compute, dynamic loss scaling whose overflow check covers every replica and worker). The model's "
        "last layer stays float32.",
        choices=PRECISIONS,
    )
    grad_accum_steps: int = _option(
        1,
        "Split each global batch into this many micro-batches, run one after another on each replica; their "
        "gradients are summed before the one optimizer update (same update, about 1/K of the activation "
        "memory). --global_batch must divide by replicas x this.",
        lower=1,
    )
    # Schedule, in global steps (one step = one global batch across all replicas).
    global_batch: int = _option(
        256,
        "Examples per step across ALL replicas and workers; each replica gets global_batch / replicas, which "
        "must divide evenly.",
        lower=1,
    )
    epochs: int = _option(
        3,
        "Passes over the training set (ignored when --train_steps is set).",
        lower=1,
    )
    train_steps: int = _option(
        0,
        "Total training steps (global batches); > 0 wins over --epochs.",
        lower=0,
    )
    steps_per_loop: int = _option(
        100,
        "Steps run inside one compiled tf.function call; logging, progress and checkpoints happen between loops.",
        lower=1,
    )
    eval_every: int = _option(
        0,
        "Evaluate on the whole test set every this many steps; 0: at each epoch end. Always also at the end. "
        "-1: never during training (a sidecar evaluator or --mode=eval does it; the default with a TF_CONFIG "
        "evaluator task).",
        lower=-1,
    )
    checkpoint_every: int = _option(
        0,
        "Save a checkpoint every this many steps; 0: at each epoch end. Always also at the end.",
        lower=0,
    )
    keep_checkpoints: int = _option(
        3,
        "How many recent checkpoints of checkpoints/ to keep (older ones are deleted; best/ is separate).",
        lower=1,
    )
    ema_decay: float = _option(
        0.0,
        "Keep an exponential moving average of the weights with this decay per update (e.g. 0.999; warm-up "
        "min(decay, (1+t)/(10+t)) over t updates); evaluated next to the trained weights (eval_ema/), and "
        "used by --best_metric, early stopping and the export. 0: off.",
        lower=0.0,
        upper=0.999999,
    )
    early_stopping_patience: int = _option(
        0,
        f"End training ({_code(exit_codes.DONE)}, final checkpoint) after this many evaluations in a row "
        "without an improvement of --best_metric by at least --early_stopping_min_delta. 0: off.",
        lower=0,
    )
    early_stopping_min_delta: float = _option(
        0.0,
        "The least improvement of --best_metric (in its own units, e.g. 0.001 accuracy) that resets "
        "--early_stopping_patience.",
        lower=0.0,
    )
    on_nonfinite: str = _option(
        "stop",
        "A NaN or Inf loss or gradient (any replica), or a loss above --loss_upper_bound: stop (end the run "
        f"naming the step, {_code(exit_codes.NON_FINITE)}, no checkpoint of the bad weights), skip (the step "
        "leaves weights and "
        "optimizer untouched) or rollback (restore the last checkpoint, move the data past the bad step, go "
        "on; --max_rollbacks times at most, then stop).",
        choices=NONFINITE_ACTIONS,
    )
    max_rollbacks: int = _option(
        3,
        "--on_nonfinite=rollback: rollbacks a run may make; the next bad step stops it "
        f"({_code(exit_codes.NON_FINITE)}). "
        "0: stop at "
        "the first.",
        lower=0,
    )
    loss_upper_bound: float = _option(
        0.0,
        "A step whose training loss (the reduced `loss` metric) exceeds this counts as bad, like a non-finite "
        "one (a loss spike); with --on_nonfinite=stop or rollback. 0: off.",
        lower=0.0,
    )
    # Output.
    model_dir: str = _option(
        "",
        "Directory for TensorBoard logs (train/, eval/), checkpoints (checkpoints/) and the exported model "
        "(export/model.keras). A directory holding a run resumes it from its latest checkpoint. Empty: "
        "runs/<dataset>-<model>-<strategy>-<YYYYmmdd-HHMMSS> (a new run).",
    )
    export: bool = _option(
        True,
        "Export the trained model at the end in --export_formats (chief only); --noexport skips it.",
    )
    export_formats: str = _option(
        "keras",
        "Comma-separated: keras (<model_dir>/export/model.keras, keras.models.load_model) and/or saved_model "
        "(<model_dir>/export/saved_model/<step>/, a serving signature on the data's raw examples: "
        "docs/serving.md).",
    )
    allow_config_change: bool = _option(
        False,
        "Resume a --model_dir even though --model, --dataset, --global_batch, --task, --optimizer, "
        "--lr_schedule, --precision, --image_size, --validation_split, --seq_len or the data's class names "
        "differ from its config.json, or its checkpoints have no config.json (the checkpoint must still match).",
    )
    # TensorBoard extras.
    summaries: str = _option(
        "full",
        "full: loop scalars + global gradient norm, sample-input, confusion-matrix and misclassified images, "
        "HParams; basic: loop scalars and the config text only.",
        choices=SUMMARIES,
    )
    histogram_every: int = _option(
        0,
        "Write weight and gradient histograms every this many steps (loops are cut to land on them); 0: off.",
        lower=0,
    )
    trace_graph: bool = _option(
        False,
        "Write the traced train loop graph for the Graphs tab (first loop only).",
    )
    profile_steps: str = _option(
        "",
        "START,END: capture a profiler trace of steps START+1..END (Profile tab; needs the `profile` extra to "
        "view); empty: off.",
    )
    # Reproducibility and compilation.
    seed: Optional[int] = _option(
        None,
        "Seed for weights and data order; default: random (printed, so it can be reused).",
    )
    deterministic: bool = _option(
        False,
        "Deterministic TensorFlow ops (slower); with --seed, runs repeat bitwise on one replica.",
    )
    jit_compile: bool = _option(
        False,
        "Compile the step with XLA. Off by default: slower for the built-in models on CPU (docs/performance.md). "
        "Refused with "
        "synchronised batch norm (cnn_bn) under mirrored strategies.",
    )
    run_eagerly: bool = _option(
        False,
        "Debugging: run the Task's train_step and eval_step as plain Python, one step at a time, so print, "
        "breakpoints and .numpy() work inside them (same results as the compiled loop; many times slower: "
        "docs/researcher-guide.md#debugging-a-step-eagerly). Refused with --jit_compile and --trace_graph.",
    )
    preflight: bool = _option(
        True,
        "Before the first training loop, try what the run reaches after training on one real batch: an "
        "evaluation step with the Task's eval_summary, derived_metrics and after_eval, the SavedModel's "
        "serving signature, a checkpoint written and read back in a temporary directory; a mistake there "
        "then stops the run in its first minute with the line it would print after training. Changes "
        "nothing of the run; its seconds are printed (docs/failures.md#the-preflight).",
    )

    def __post_init__(self):
        if not self.model_dir:  # a new run's directory, named once here
            object.__setattr__(self, "model_dir", default_model_dir(self.dataset, self.model, self.strategy))

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def options() -> tuple:
    """Config's fields in flag order: (name, type name, default, metadata) for flags/definitions.py."""
    hints = {"str": str, "int": int, "float": float, "bool": bool}
    return tuple(
        (field.name, hints[field.type.replace("Optional[", "").rstrip("]")], field.default, field.metadata)
        for field in dataclasses.fields(Config)
    )
