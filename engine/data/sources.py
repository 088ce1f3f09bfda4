"""`--dataset` -> a validated source: what the Task's data is and where it comes from.

Built-in names (in memory): mnist, fashion_mnist, synthetic. Sources with an argument:
  npz:PATH                          arrays x_train, y_train, x_test, y_test of any shape (in memory)
  tfrecord:TRAIN_GLOB[,TEST_GLOB]   tf.train.Example shards, streamed (engine/data/tfrecord.py)
  images:DIR                        JPEG/PNG files in class folders: DIR/train/<class>/, DIR/test/<class>/,
                                    or DIR/<class>/ with --validation_split; streamed, resized with
                                    --image_size (also tfrecord: images) (engine/data/image_folders.py)
  tfds:NAME[:CONFIG]                a TensorFlow Datasets builder prepared under --data_dir, streamed
                                    (engine/data/tfds_source.py; tensorflow-datasets imported only then)
  text:PATH                         UTF-8 text (a file, a directory or a glob of files) as windows of
                                    --seq_len byte tokens and their next bytes, in memory (engine/data/text.py)
A source is an `ArraySource` (engine/data/arrays.py) or a `StreamSource` (engine/data/streams.py):
both give `spec` (a DataSpec), `num_train`, `num_test` and their pipelines. With
--input_mode=resident a streamed source is read whole into an ArraySource (engine/data/into_memory.py).
"""

from __future__ import annotations

import os

from engine.config import DATASETS
from engine.data import builtin, image_folders, into_memory, text, tfds_source, tfrecord
from engine.data.task_data import TaskSource
from engine.errors import UserError

# Flags only some sources read: flag -> (the --dataset kinds that read it, how an error names them).
SOURCE_OPTIONS = {
    "image_size": (("images", "tfrecord"), "--dataset=images:DIR and tfrecord: images"),
    "validation_split": (("images",), "--dataset=images:DIR"),
    "cache": (("tfrecord", "images", "tfds"), "streamed sources (tfrecord:, images:, tfds:)"),
}


def load_for_task(config, task_class):
    """The Task's own pipelines (`Task.datasets`) when it has them, else the `--dataset` source."""
    own = task_class.datasets(config)
    if own is None:
        return load(config, parse_example=task_class.parse_example)
    if config.cache:
        raise UserError(
            f"--cache applies to streamed --dataset sources, but {task_class.__name__}.datasets() "
            "builds its own tf.data pipelines: cache in them (Dataset.cache) and drop --cache"
        )
    if config.input_mode == "resident":
        raise UserError(
            f"--input_mode=resident reads a --dataset into memory, but {task_class.__name__}.datasets() "
            "builds its own tf.data pipelines, which the engine streams: drop --input_mode"
        )
    return TaskSource(task_class.__name__, own)


# --dataset=NAME: the built-in in-memory sets (engine/data/builtin.py), by name.
BUILTIN = {
    "mnist": builtin.load_mnist,
    "fashion_mnist": builtin.load_fashion_mnist,
    "synthetic": builtin.load_synthetic,
}
assert tuple(BUILTIN) == DATASETS, "engine/config.py DATASETS and BUILTIN must name the same sets"

# --dataset=KIND:ARGUMENT -> loader(argument, config, parse_example), each in its own module.
SOURCE_KINDS = {
    "npz": lambda argument, config, parse_example: builtin.load_npz(argument, config),
    "tfrecord": tfrecord.load,
    "images": lambda argument, config, parse_example: image_folders.load(argument, config),
    "tfds": lambda argument, config, parse_example: tfds_source.load(argument, config),
    "text": lambda argument, config, parse_example: text.load(argument, config),
}


def load(config, parse_example=None):
    """The source `config.dataset` names, validated. `parse_example`: a Task's record parser."""
    kind, colon, argument = config.dataset.partition(":")
    if config.data_dir is not None and not os.path.isdir(config.data_dir):
        raise UserError(f"--data_dir={config.data_dir} is not a directory")
    _check_source_options(config, kind if colon else None)
    if not colon:
        if kind not in BUILTIN:
            raise UserError(
                f"unknown --dataset={config.dataset!r}; valid: {', '.join(DATASETS)}, or "
                f"{', '.join(k + ':...' for k in SOURCE_KINDS)}"
            )
        source = BUILTIN[kind](config)
    elif kind not in SOURCE_KINDS or not argument:
        raise UserError(
            f"--dataset={config.dataset!r}: expected one of {', '.join(DATASETS)} or "
            "npz:PATH, tfrecord:TRAIN_GLOB[,TEST_GLOB], images:DIR, tfds:NAME[:CONFIG], text:PATH"
        )
    else:
        source = SOURCE_KINDS[kind](argument, config, parse_example)
    _check_options(config, source)
    if config.input_mode == "resident" and source.streamed:
        source = into_memory.read_whole(source)  # every record decoded once, then trained from memory
    return source


def _check_source_options(config, kind) -> None:
    """Flags given to a source that would ignore them (checked before any data is read; tfrecord:
    checks later that its records hold images for --image_size)."""
    for name, (kinds, applies) in SOURCE_OPTIONS.items():
        value = getattr(config, name)
        if value and kind not in kinds:
            shown = f"--{name}" if value is True else f"--{name}={value}"
            raise UserError(f"{shown} applies to {applies} only, not --dataset={config.dataset}; drop it")
    if config.cache and config.input_mode == "resident":
        raise UserError(
            f"--cache with --input_mode=resident: --dataset={config.dataset} is read into memory once "
            "at start-up, so there is nothing left to cache; drop --cache"
        )


def _check_options(config, source) -> None:
    if config.num_classes and source.spec.num_classes not in (None, config.num_classes):
        raise UserError(f"--num_classes={config.num_classes} but {source.where} has {source.spec.num_classes} classes")
