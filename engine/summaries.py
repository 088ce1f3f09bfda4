"""TensorBoard writers. Only the chief writes; other workers get writers that do nothing."""

from __future__ import annotations

import os

import tensorflow as tf


class SummaryWriter:
    """A small writer interface: write_scalars(step, {name: value}), write_text, flush, close."""

    def __init__(self, logdir: str | None):
        self.logdir = logdir
        self._writer = tf.summary.create_file_writer(logdir) if logdir else None

    def write_scalars(self, step: int, scalars: dict) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)

    def write_text(self, step: int, name: str, text: str) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=step):
            tf.summary.text(name, text)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def create_writers(model_dir: str, is_chief: bool) -> dict:
    """{"train": ..., "eval": ...} writing to model_dir/train and model_dir/eval on the chief."""
    return {
        split: SummaryWriter(os.path.join(model_dir, split) if is_chief else None)
        for split in ("train", "eval")
    }
