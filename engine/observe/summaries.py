"""TensorBoard writers. Only the chief writes; other workers get writers that do nothing, so a
summary never adds work (or a collective) on them. Every method runs on the host, between
compiled loops; only `trace_graph` touches a traced function (see start_graph_trace)."""

from __future__ import annotations

import functools
import os

import numpy as np
import tensorflow as tf

from engine.observe import figures, hparams


def _writes(method):
    """A method that writes at `step` on the chief and does nothing elsewhere."""

    @functools.wraps(method)
    def write(self, step: int, *args, **kwargs) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            method(self, step, *args, **kwargs)

    return write


class SummaryWriter:
    """A small writer interface: write_scalars(step, {name: value}), write_text, write_images,
    write_figure (a matplotlib figure), write_tensor (another plugin's data), write_histograms,
    write_hparams, the graph trace, flush, close."""

    def __init__(self, logdir: str | None):
        self.logdir = logdir
        self._writer = tf.summary.create_file_writer(logdir) if logdir else None
        # {names: None (written once, eagerly) or a compiled writer of those names}
        self._scalar_writers = {}

    def write_scalars(self, step: int, scalars: dict, every_loop: bool = False) -> None:
        """Names written again (every loop's scalars) are written by one compiled call instead of
        an eager op chain per scalar, which costs about as much per scalar as the compiled call for
        all of them (docs/tensorboard.md, what it costs). A name set is compiled the second time it
        is written, or at once with `every_loop` (its trace then falls in the run's first loop,
        which the run's throughput leaves out, not in a timed one). The compiled call enters its
        writer itself (and flushes it once, as as_default does on exit)."""
        if self._writer is None:
            return
        names = tuple(scalars)
        if names not in self._scalar_writers and not every_loop:
            self._scalar_writers[names] = None
            self._write_scalars_eagerly(step, scalars)
            return
        if self._scalar_writers.get(names) is None:
            self._scalar_writers[names] = tf.function(functools.partial(_write_scalars, self._writer, names))
        values = np.array([float(value) for value in scalars.values()], np.float32)
        self._scalar_writers[names](tf.constant(step, tf.int64), tf.constant(values))

    @_writes
    def _write_scalars_eagerly(self, step: int, scalars: dict) -> None:
        for name, value in scalars.items():
            tf.summary.scalar(name, value)

    @_writes
    def write_text(self, step: int, name: str, text: str) -> None:
        tf.summary.text(name, text)

    @_writes
    def write_images(self, step: int, name: str, images, description: str | None = None) -> None:
        """images: uint8 (n, h, w, 3) or floats in [0, 1]; None writes nothing."""
        if images is not None:
            tf.summary.image(name, images, max_outputs=len(images), description=description)

    @_writes
    def write_figure(self, step: int, name: str, figure, description: str | None = None) -> None:
        """A matplotlib figure (engine/observe/figures.py: new_figure) as the image `name`; drawn
        only on the chief."""
        tf.summary.image(name, figures.figure_to_image(figure), max_outputs=1, description=description)

    @_writes
    def write_tensor(self, step: int, tag: str, tensor, metadata: bytes) -> None:
        """A tensor with a plugin's serialized SummaryMetadata (PR curves, the Custom Scalars layout)."""
        tf.summary.write(tag, tensor, metadata=metadata)

    @_writes
    def write_histograms(self, step: int, histograms: dict) -> None:
        for name, values in histograms.items():
            tf.summary.histogram(name, values)

    def write_hparams(self, values: dict, metric_names, trial_id: str) -> None:
        if self._writer is not None:
            hparams.write_session(self._writer, values, metric_names, trial_id)

    def start_graph_trace(self) -> None:
        """Call before the first call (first trace) of the function whose graph is wanted."""
        if self._writer is not None:
            tf.summary.trace_on(graph=True, profiler=False)

    @_writes
    def write_graph_trace(self, step: int, name: str) -> None:
        tf.summary.trace_export(name, step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _write_scalars(writer, names, step, values):
    with writer.as_default(step=step):
        for i, name in enumerate(names):
            tf.summary.scalar(name, values[i])


def create_writers(model_dir: str, is_chief: bool, splits=("train", "eval")) -> dict:
    """{"train": ..., "eval": ...} writing to model_dir/train and model_dir/eval on the chief (and
    model_dir/<split> for any other of `splits`, e.g. eval_ema)."""
    return {split: SummaryWriter(os.path.join(model_dir, split) if is_chief else None) for split in splits}
