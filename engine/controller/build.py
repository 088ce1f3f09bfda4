"""Set-up pieces the training job (engine/controller/trainer.py) and the evaluation job
(engine/controller/evaluator.py) share, so both build the model, optimizer and counters the same
way (inside strategy.scope()) and evaluate the same way."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from engine.controller.state import create_state
from engine.data import pipelines, sources
from engine.errors import UserError
from engine.loop import ratios
from engine.tasks.registry import load_task_class


@contextlib.contextmanager
def job(config):
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
        hint = ("; `python -m engine.data.image_folders DIR` lists every bad file"
                if config.dataset.startswith("images:") else "")
        raise UserError(f"--dataset={config.dataset}: the input pipeline failed: {_first_cause(err)}{hint}") from None
    finally:
        keras.mixed_precision.set_dtype_policy(previous_policy)


def from_input_pipeline(err) -> bool:
    """A bad record or file met while reading (decoding, parsing), not a bug in the step."""
    return isinstance(err, (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError)) and (
        "IteratorGetNext" in str(err) or "MultiDeviceIteratorGetNextFromShard" in str(err))


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
    from tensorflow.python.framework import config as tf_config

    if getattr(tf_config, "is_op_determinism_enabled", lambda: False)():
        tf_config.disable_op_determinism()


def load_data(config):
    """(Task class, its data source, training steps per epoch at `config.global_batch`)."""
    task_class = load_task_class(config.task)
    data = sources.load_for_task(config, task_class)
    return task_class, data, pipelines.steps_per_epoch(data, config.global_batch)


def build_task_state(config, placement, task_class, data, *, seed: int, total_steps: int, writable: bool = True):
    """The Task and its TrainState (model, built optimizer, updater, counters) in strategy.scope().
    writable=False: a checkpoint that only reads (an evaluator never saves into the run)."""
    task = task_class(config, spec=data.spec)
    task.total_steps = total_steps
    state = create_state(placement.strategy, task, seed=seed, model_dir=config.model_dir,
                         is_chief=placement.is_chief, keep=config.keep_checkpoints, writable=writable)
    return task, state


def evaluate_split(eval_loop, eval_data, task, num_test: int, step: int) -> tuple[dict, str]:
    """Runs the eval loop over the whole test split: ({metric: value}, the console line). The
    metrics include the Task's derived ones (e.g. perplexity from the per-token loss)."""
    result = eval_loop(eval_data)
    metrics, examples = ratios(result["totals"]), int(result["examples"].numpy())
    metrics.update(task.derived_metrics(metrics))
    seen = f"{examples} examples" if examples == num_test else (
        f"{examples} examples evaluated, but the test split has {num_test}: its pipeline "
        "missed or repeated some")
    return metrics, f"eval   step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f"  ({seen})"
