"""The frozen run configuration. flags/ builds it from the command line; tests build it directly."""

from __future__ import annotations

import dataclasses
from typing import Optional


# The names the engine accepts, in one place (no TensorFlow import: flags/ uses them for --help).
STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored")
DATASETS = (
    "mnist",
    "fashion_mnist",
    "synthetic",
)  # built-in names; also npz:PATH, tfrecord:GLOB[,GLOB], images:DIR, tfds:NAME[:CONFIG], text:PATH
INPUT_MODES = ("auto", "distribute_dataset", "per_worker", "resident")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
LR_SCHEDULES = ("constant", "cosine", "warmup_cosine")
MODES = ("train", "eval", "continuous_eval")
# --best_metric without a sign: the direction of the known metric names (+: higher is better).
METRIC_DIRECTIONS = {"accuracy": "+", "loss": "-"}


def resolved_input_mode(config, source, augmented: bool) -> str:
    """The input mode a run uses: "streamed" for sources read from files (always one pipeline per
    worker), else --input_mode, auto being resident (in-memory arrays are at most 1 GiB:
    engine/data/arrays.py; no tf.data work per step) unless the Task augments each example
    (`augmented`): then distribute_dataset, whose parallel, prefetched pipeline augments beside the
    step instead of inside it."""
    if source.streamed:
        return "streamed"
    if config.input_mode == "auto":
        return "distribute_dataset" if augmented else "resident"
    return config.input_mode


@dataclasses.dataclass(frozen=True)
class Config:
    # What this process does: train, evaluate one checkpoint, or evaluate each new one (a sidecar).
    mode: str = "train"
    checkpoint: str = ""  # --mode=eval: this checkpoint (path prefix) instead of model_dir's latest.
    eval_timeout: float = 3600.0  # seconds an evaluator waits for config.json / a new checkpoint.
    best_metric: str = ""  # "accuracy", "loss", "+name" (higher better), "-name" (lower); "": off.
    evaluator: bool = False  # --num_workers launcher: also start one local evaluator process.
    # Distribution.
    strategy: str = "default"
    cpu_replicas: int = 1
    collective_timeout: float = 300.0  # seconds before a missing multi-worker peer is an error.
    num_workers: int = 0  # > 0 without TF_CONFIG: start that many local workers.
    max_restarts: int = 0  # --num_workers launcher: restarts of the whole cluster after a retryable failure.
    stall_timeout: float = 600.0  # seconds without a completed step before a worker exits "stalled"; 0: off.
    input_mode: str = "auto"  # in-memory sources: resident (distribute_dataset if the Task augments); or per_worker
    # Data.
    dataset: str = "synthetic"
    data_dir: Optional[str] = None
    synthetic_train_examples: int = 60000
    synthetic_test_examples: int = 10000
    synthetic_shape: str = "28,28"  # one synthetic example's shape: "28,28" grey, "32,32,3" colour.
    num_classes: int = 0  # 0: from the data (the largest label + 1; 10 for the built-in sets).
    shuffle_buffer: int = 10000  # examples in the shuffle buffer of streamed sources.
    cache: bool = False  # streamed sources: keep the raw records in memory after the first pass.
    image_size: str = ""  # images:DIR: "H,W" pixels to resize every image to; "": the files' own (shared) size.
    validation_split: float = 0.0  # images:DIR without train/ and test/: fraction of each class held out.
    seq_len: int = 128  # text:PATH: tokens (bytes) per example.
    # Model and task.
    model: str = "cnn"
    task: str = "classification"
    optimizer: str = "adam"
    learning_rate: Optional[float] = None  # None: the optimizer's default (see engine/optimizers.py).
    lr_schedule: str = "constant"  # or "cosine", "warmup_cosine" (over the run's optimizer updates).
    warmup_steps: int = 0  # linear warm-up updates of "warmup_cosine".
    weight_decay: float = 0.0  # decoupled weight decay per update (AdamW with adam); 0: off.
    clip_norm: float = 0.0  # clip the global norm of the cross-replica-summed gradient; 0: off.
    precision: str = "float32"  # or "mixed_bfloat16", "mixed_float16" (dynamic loss scaling).
    grad_accum_steps: int = 1  # micro-batches per global batch, gradients summed before the update.
    # Schedule, in global steps (one step = one global batch across all replicas).
    global_batch: int = 256
    epochs: int = 3
    train_steps: int = 0  # > 0 wins over epochs.
    steps_per_loop: int = 100
    eval_every: int = 0  # 0: at each epoch end; -1: never in training (a sidecar evaluates).
    checkpoint_every: int = 0  # 0: at each epoch end.
    keep_checkpoints: int = 3
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: "stop" the run, "skip" the step, or "rollback".
    max_rollbacks: int = 3  # --on_nonfinite=rollback: rollbacks before the run stops as with "stop".
    loss_upper_bound: float = 0.0  # a training loss above this counts as a bad step (a spike); 0: off.
    ema_decay: float = 0.0  # exponential moving average of the weights; 0: off.
    early_stopping_patience: int = 0  # evaluations without improvement of --best_metric before stopping; 0: off.
    early_stopping_min_delta: float = 0.0  # the least change of --best_metric that counts as improvement.
    allow_config_change: bool = False  # resume even if model/dataset/global_batch/task changed.
    # Output.
    model_dir: str = "runs/default"
    export: bool = True
    export_formats: str = "keras"  # comma-separated: "keras" (export/model.keras), "saved_model" (serving).
    # TensorBoard extras (engine/observe/monitor.py).
    summaries: str = "full"  # "full": + grad_norm, images, hparams; "basic": loop scalars and config text.
    histogram_every: int = 0  # weight/gradient histograms every this many steps; 0: off.
    trace_graph: bool = False  # write the traced train loop graph (Graphs tab).
    profile_steps: str = ""  # "START,END": profiler trace of steps START+1..END; "": off.
    # Reproducibility and compilation.
    seed: Optional[int] = None
    deterministic: bool = False
    jit_compile: bool = False

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
