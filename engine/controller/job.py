"""What every job (training: engine/controller/trainer.py; evaluation: engine/controller/evaluator.py)
does before its Task exists: the job's context (the --precision dtype policy, bad input records
and a Task method failing while traced turned into one line), seeding, and loading the Task class with its data."""

from __future__ import annotations

import contextlib
import os

import keras
import tensorflow as tf

from engine import compat
from engine.controller import error_files
from engine.data import pipelines, sources
from engine.distribute.cluster import parse_tf_config
from engine.errors import StepFailed, UserError
from engine.tasks.registry import load_task_class


@contextlib.contextmanager
def context(config):
    """Around a whole job (training or evaluation): Keras' dtype policy set to --precision for the
    layers built inside (and put back after), and a bad record or file met while reading turned into
    a one-line UserError naming the source instead of TensorFlow's traceback."""
    previous_policy = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(config.precision)
    try:
        yield
    except tf.errors.OpError as err:
        if not from_input_pipeline(err):
            raise
        hint = (
            "; `python -m engine.data.image_folders DIR` lists every bad file"
            if config.dataset.startswith("images:")
            else ""
        )
        raise UserError(f"--dataset={config.dataset}: the input pipeline failed: {_first_cause(err)}{hint}") from None
    except StepFailed as err:  # one line on the console, the whole traceback in errors/
        tf_config = os.environ.get("TF_CONFIG")
        written = error_files.write(
            config.model_dir,
            "traced",
            err.message,
            err.traceback_text,
            is_chief=not tf_config or parse_tf_config(tf_config).is_chief,
        )
        raise StepFailed(f"{err.message}; the full traceback is in {written}; fix it, then rerun") from None
    finally:
        keras.mixed_precision.set_dtype_policy(previous_policy)


def from_input_pipeline(err) -> bool:
    """A bad record or file met while reading (decoding, parsing), not a bug in the step."""
    return isinstance(err, (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError)) and (
        "IteratorGetNext" in str(err) or "MultiDeviceIteratorGetNextFromShard" in str(err)
    )


def _first_cause(err) -> str:
    """The line of TensorFlow's message that says what went wrong (not the graph-location lines)."""
    noise = ("Graph execution error", "Detected at node", "<stack traces unavailable>", "[[")
    lines = [line.strip() for line in str(err.message).splitlines()]
    causes = [line for line in lines if line and not line.startswith(noise)]
    return (causes[0] if causes else lines[0])[:300]


def seed_everything(seed: int, deterministic: bool) -> None:
    keras.utils.set_random_seed(seed)
    set_op_determinism(deterministic)


def set_op_determinism(on: bool) -> None:
    """As the flag says, for this run: the switch is process-wide, and a previous in-process run
    (a test, a notebook) may have turned it on. TensorFlow has no public switch-off."""
    if on:
        tf.config.experimental.enable_op_determinism()
        return
    compat.disable_op_determinism()


def load_data(config):
    """(Task class, its data source, training steps per epoch at `config.global_batch`)."""
    task_class = load_task_class(config.task)
    data = sources.load_for_task(config, task_class)
    return task_class, data, pipelines.steps_per_epoch(data, config.global_batch)
