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
from engine.data import bad_records, pipelines, sources
from engine.distribute.cluster import parse_tf_config
from engine.errors import StepFailed, UserError
from engine.tasks.registry import load_task_class


# The source each running job of this process loaded (load_data), innermost last: a failed
# input pipeline is named from it (engine/data/bad_records.py).
_loaded: list = []


@contextlib.contextmanager
def context(config):
    """Around a whole job (training or evaluation): Keras' dtype policy set to --precision for the
    layers built inside (and put back after), and a bad record or file met while reading turned into
    a one-line UserError naming the file, the record and the cause instead of TensorFlow's traceback."""
    previous_policy = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(config.precision)
    _loaded.append(None)
    try:
        yield
    except (tf.errors.OpError, UnicodeDecodeError) as err:
        if not from_input_pipeline(err):
            raise
        raise input_failed(err, config) from None
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
        _loaded.pop()
        keras.mixed_precision.set_dtype_policy(previous_policy)


def from_input_pipeline(err) -> bool:
    """A bad record or file met while reading (decoding, parsing), not a bug in the step."""
    if bad_records.is_undecodable_message(err):
        return True
    # The ops that pull from a pipeline: an iterator's next (training), the eval loop's reduction over a dataset.
    readers = ("IteratorGetNext", "MultiDeviceIteratorGetNextFromShard", "ReduceDataset")
    errors = (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError)
    return isinstance(err, errors) and any(op in str(err) for op in readers)


def input_failed(err, config, step=None, kept: str = "") -> UserError:
    """The one line of a failed input pipeline: the bad file, its record and the cause, found by
    reading the source's files again (bad_records.locate); `step`: the last step trained, `kept`:
    what the run kept (its checkpoint) and how to go on."""
    source = _loaded[-1] if _loaded else None
    cause = bad_records.first_cause(err)
    found = bad_records.locate(source, source.loaded_at) if getattr(source, "streamed", False) else ""
    if found:
        what = found
    elif found is None:
        what = f"{cause} (every file of the data reads back whole now: a passing read error? rerun to resume)"
    else:
        what = cause + (
            "; `python -m engine.data.image_folders DIR` lists every bad file"
            if config.dataset.startswith("images:")
            else ""
        )
    after = "" if step is None else f" after step {step}"
    return UserError(f"--dataset={config.dataset}: the input pipeline failed{after}: {what}{kept}")


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
    if _loaded:
        _loaded[-1] = data
    return task_class, data, pipelines.steps_per_epoch(data, config.global_batch)
