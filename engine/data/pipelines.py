"""A source's tf.data pipelines, split across replicas and workers, at the GLOBAL batch.

In-memory sources (engine/data/arrays.py) go through `--input_mode`: one pipeline of global
batches split by `strategy.experimental_distribute_dataset`, per-worker pipelines
(`distribute_datasets_from_function`) that keep each worker's slice of the same global batches, or
no pipeline: the arrays in every replica's memory, gathered inside the loop (engine/data/resident.py).
The default, auto, is resident (no tf.data work per step: faster where a step is short,
docs/performance.md), or distribute_dataset when the Task augments each example (the pipeline's
parallel map augments beside the step).
Streamed sources (engine/data/streams.py) always build one pipeline per worker with
`distribute_datasets_from_function`, sharded by file or by record.

No tf.data autotuning, in the engine's pipelines (`formats.with_options`) nor on the per-device
datasets TensorFlow builds to distribute them: deleting an iterator of an autotuned dataset could
block for up to a minute. Its autotune thread sleeps between optimisations (periods 10 ms doubling
up to 60 s), and the iterator's destructor wakes it and waits for it; TF 2.21's CancellationManager
runs that wake-up callback before it marks itself cancelled, so a thread that wakes at once sees
"not cancelled" and sleeps out the rest of its period (a finished run's process lingered for
seconds after its summary, the main thread in ~RootDataset::Iterator, holding the GIL:
docs/performance.md, "Whole process"). Without autotuning there is no such thread; AUTOTUNE values
then take TensorFlow's static defaults, which train as fast (docs/performance.md, "Input from files").
"""

from __future__ import annotations

from engine import compat
from engine.config import INPUT_MODES, resolved_input_mode
from engine.data import resident
from engine.data.formats import augmented_spec
from engine.errors import UserError


def training_example(source, augment):
    """One training example as `train_step` gets it (a structure of tf.TensorSpec) when the Task
    augments it, else None; a structure the engine cannot batch is refused here, at start-up, in
    one line (engine/data/formats.py augmented_spec). A Task's own pipelines augment themselves."""
    if augment is None or not getattr(source, "engine_augments", True):
        return None
    return augmented_spec(augment, source.spec.features, source.spec.labels)


def distributed_train_data(strategy, source, config, seed: int, skip_batches: int, augment=None):
    """The endless training stream split across replicas. `augment`: the Task's per-example
    augmentation (`Task.example_augmentation(seed)`), or None."""
    compat.device_datasets_without_autotune()
    training_example(source, augment)  # refused before any pipeline is traced
    mode = resolved_input_mode(config, source, augmented=augment is not None)
    if mode == "streamed":
        return strategy.distribute_datasets_from_function(
            source.train_dataset_fn(config.global_batch, seed, skip_batches, augment)
        )
    if mode == "resident":
        return resident.ResidentTrainData(strategy, source, config.global_batch, seed, skip_batches, augment)
    if mode == "per_worker":
        return strategy.distribute_datasets_from_function(
            source.per_worker_train_dataset_fn(config.global_batch, seed, skip_batches, augment)
        )
    if mode != "distribute_dataset":
        raise UserError(f"unknown --input_mode={config.input_mode!r}; valid: {', '.join(INPUT_MODES)}")
    return strategy.experimental_distribute_dataset(
        source.train_dataset(config.global_batch, seed, skip_batches, augment)
    )


def distributed_eval_data(strategy, source, config):
    """Every test example exactly once, split across replicas (and workers)."""
    compat.device_datasets_without_autotune()
    if source.streamed:
        return strategy.distribute_datasets_from_function(source.eval_dataset_fn(config.global_batch))
    return strategy.experimental_distribute_dataset(source.eval_dataset(config.global_batch))


def distributed_eval_batches(strategy, source, config, batches: int):
    """The first `batches` global eval batches of each input pipeline, split like
    distributed_eval_data (the same element spec: the eval loop runs it without tracing again)."""
    compat.device_datasets_without_autotune()
    if source.streamed:
        dataset_fn = source.eval_dataset_fn(config.global_batch)
        return strategy.distribute_datasets_from_function(lambda context: dataset_fn(context).take(batches))
    return strategy.experimental_distribute_dataset(source.eval_dataset(config.global_batch).take(batches))


def steps_per_epoch(source, global_batch: int) -> int:
    steps = source.num_train // global_batch
    if steps == 0:
        raise UserError(f"--global_batch={global_batch} is larger than the {source.num_train} training examples")
    return steps
