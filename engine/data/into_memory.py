"""`--input_mode=resident` for a streamed source: every record read and decoded once, at start-up,
into in-memory arrays (an ArraySource), then trained like `npz:` data.

Small file-based data then trains at the speed of memory: no tf.data work per step, where a 2-core
host pays for a streamed pipeline's CPU in the step's own time (docs/performance.md "Input from
files"). The examples are the streamed decoder's, bit for bit: uint8 images are kept as uint8 (the
decoder's normalised values scaled back, exactly) and normalised by the same function in the loop.
The order differs from streaming (a permutation of all examples each epoch instead of a shuffle
buffer), so the run records it and a resume in the other mode is refused (run_record.py).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from engine.data import bad_records
from engine.data.arrays import MAX_IN_MEMORY_BYTES, ArraySource
from engine.errors import UserError

DECODE_BATCH = 1024  # records decoded per call while reading everything in


def _keeps_raw_bytes(spec) -> bool:
    """uint8 features (images) are held as their raw bytes, anything else as decoded."""
    return spec.raw_features is not None and spec.raw_features.dtype == tf.uint8


def _example_bytes(spec) -> int:
    """Bytes one example takes in memory: its features as the arrays hold them, plus its label."""
    features = spec.raw_features if _keeps_raw_bytes(spec) else spec.features
    return sum(s.shape.num_elements() * s.dtype.size for s in (features, spec.labels))


def _stored_features(x: np.ndarray, spec) -> np.ndarray:
    """Decoded (normalised) features -> what the arrays hold: uint8 images as their raw bytes (x /
    255 in float32 scales back exactly; tests/test_resident.py checks the round trip on every
    value), anything else as decoded."""
    if not _keeps_raw_bytes(spec) or x.dtype != np.float32:
        return x
    return np.rint(x * 255.0).astype(np.uint8).reshape(len(x), *spec.raw_features.shape)


def _read_split(source, split: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for x, y in source.decoded_batches(split, DECODE_BATCH):
        xs.append(_stored_features(x, source.spec))
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def read_whole(source) -> ArraySource:
    """`source` (a StreamSource) read into memory; a UserError before reading anything when the
    data would exceed the in-memory limit, and one naming the file when a record does not decode."""
    size = (source.num_train + source.num_test) * _example_bytes(source.spec)
    if size > MAX_IN_MEMORY_BYTES:
        raise UserError(
            f"--input_mode=resident: {source.where} holds {source.num_train + source.num_test:,} "
            f"examples, {size / 2**30:.1f} GiB in memory, over the {MAX_IN_MEMORY_BYTES / 2**30:.0f} GiB "
            "limit of in-memory data; drop --input_mode to stream it"
        )
    try:
        x_train, y_train = _read_split(source, "train")
        x_test, y_test = _read_split(source, "test")
    except (
        tf.errors.InvalidArgumentError,
        tf.errors.DataLossError,
        tf.errors.NotFoundError,
        UnicodeDecodeError,
    ) as err:
        found = bad_records.locate(source, source.loaded_at)  # the bad file by name, as a streamed run names it
        raise UserError(
            f"--input_mode=resident: reading {source.where} into memory failed: {found or bad_records.first_cause(err)}"
        ) from None
    return ArraySource(
        source.name,
        f"{source.where}, read into memory (--input_mode=resident)",
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=source.spec.num_classes,
        class_names=source.spec.class_names,
    )
