"""--preflight: before the first training loop, what the run reaches only after training, tried
on one real batch, so a Task's mistake there costs seconds, not a training run.

  evaluation   the compiled eval loop on the first eval batch (the same trace the real evaluations
               then use), with Task.derived_metrics and Task.eval_summary on what it collected;
               a collection the whole test split would not fit in host memory is refused
  after_eval   Task.after_eval into a temporary writer (--summaries=full, the chief)
  signature    the SavedModel's serving signature traced (--export with saved_model, the chief)
  checkpoint   the whole checkpoint written into a temporary directory of model_dir and read back

A failure ends the run with the line the same failure would print after training (the same code
paths: evaluation.evaluate_split, the trainer's extras). Nothing of the run changes: no metric,
event file, checkpoint or data position is kept (the eval loop's batch counter, the stall watch's,
moves). Left out: the pictures (they predict the whole test set), the actions' after-evaluation
work (best, early stopping, EMA evaluation) and the .keras export. Several workers skip the
evaluation part (each worker's first batch may differ in size from the others')."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import tensorflow as tf

from engine.controller import evaluation, storage
from engine.controller import export as exporters
from engine.controller.actions.eval_summaries import EvalSummaries
from engine.controller.actions.export import Export, parse_formats
from engine.data import pipelines
from engine.loop import several_workers
from engine.observe.summaries import SummaryWriter


def check(trainer) -> str:
    """Runs the preflight for the trainer's built run; returns its line for the console."""
    built = trainer.built
    config, task, placement = built.config, built.task, built.placement
    started, checked = time.perf_counter(), []
    if built.schedule.eval_every >= 0 and not several_workers(placement.strategy):
        one_batch = pipelines.distributed_eval_batches(placement.strategy, built.data, config, 1)
        evaluation.evaluate_split(built.eval_loop, one_batch, task, built.data.num_test, trainer.step, preflight=True)
        checked.append("evaluation")
        if built.monitor.full and placement.is_chief:
            with tempfile.TemporaryDirectory(prefix="ctl-preflight-") as directory, trainer.extra(EvalSummaries.name):
                writer = SummaryWriter(directory)
                try:
                    task.after_eval(trainer.step, writer)
                finally:
                    writer.close()
            checked.append("after_eval")
    if config.export and "saved_model" in parse_formats(config.export_formats) and placement.is_chief:
        with trainer.extra(Export.name):
            exporters.serving_module(task.export_model(), built.data.spec).serve.get_concrete_function()
        checked.append("serving signature")
    _checkpoint_round_trip(built)
    checked.append("checkpoint")
    return (
        f"preflight    {', '.join(checked)} tried on one batch before training: "
        f"{time.perf_counter() - started:.1f} s (--nopreflight skips it)"
    )


def _checkpoint_round_trip(built) -> None:
    """The whole checkpoint written into a hidden temporary directory of model_dir (the disk the
    run's checkpoints go to; on other workers than the chief a system temporary directory, as
    their real saves) and every tensor read back; the directory is removed."""
    model_dir, directory = built.config.model_dir, None
    try:
        directory = tempfile.mkdtemp(prefix=".preflight-", dir=model_dir if built.placement.is_chief else None)
        path = built.state.checkpointer.checkpoint.write(os.path.join(directory, "ckpt"))
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, OSError) as err:
        cause = storage.cause(err)
        if cause is None:
            raise
        raise storage.failed(f"writing a trial checkpoint into {directory or model_dir}", cause, model_dir) from None
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
