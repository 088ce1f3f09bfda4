"""`--dataset=tfrecord:TRAIN_GLOB[,TEST_GLOB]`: tf.train.Example records, streamed.

The default schema (what `write_shards` writes), one example per record:
  "image"  bytes: an encoded PNG or JPEG image (decoded with tf.io, to float [0, 1]; resized to
           --image_size=H,W when given, else all must share the first record's size),  or
  "x"      bytes: the example's features as tf.io.serialize_tensor (any shape and dtype),
  "label"  int64 (a class id) or float (a regression target), one value or a fixed-length list.
A Task with its own record layout defines `parse_example(serialized) -> (features, label)` as a
staticmethod; the engine then uses it instead (--num_classes says the class count).

Write shards from arrays (any `npz:` file with x_train, y_train, x_test, y_test):
  python -m engine.data.tfrecord --npz=data.npz --out=DIR --shards=8
  python run.py --dataset=tfrecord:DIR/train-*.tfrecord,DIR/test-*.tfrecord
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np
import tensorflow as tf

from tensorflow.core.framework import tensor_pb2

from engine.data import bad_records, image_folders, streams
from engine.data.formats import check_example_pair, normalise_features, normalise_labels
from engine.data.spec import DataSpec
from engine.errors import UserError


def _files(pattern: str, what: str) -> np.ndarray:
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise UserError(f"--dataset=tfrecord: the {what} pattern {pattern!r} matches no file")
    return np.array(files)


def _first_example(path: str) -> tf.train.Example:
    for record in tf.data.TFRecordDataset(path).take(1):
        try:
            return tf.train.Example.FromString(record.numpy())
        except Exception:
            raise UserError(f"{path}: its first record is not a tf.train.Example") from None
    raise UserError(f"{path}: holds no records")


def _default_schema(path: str, image_size: str = ""):
    """(decode, decode_batch, features spec, raw features spec) of the default schema, from the first
    record of `path`: decode parses one record, decode_batch a batch of them at once (one
    parse_example; serialized tensors sliced out of the batch's bytes without a per-record call);
    the raw spec (one example before normalisation) is None for resized images."""
    features = _first_example(path).features.feature
    if "label" not in features or ("image" not in features and "x" not in features):
        raise UserError(
            f"{path}: records have features {sorted(features)}; the default schema needs 'label' and "
            "'image' (encoded PNG/JPEG) or 'x' (serialized tensor); or give the Task a parse_example"
        )
    label = features["label"]
    label_dtype, label_len = (
        (tf.int64, len(label.int64_list.value))
        if label.WhichOneof("kind") == "int64_list"
        else (tf.float32, len(label.float_list.value))
    )
    label_shape = () if label_len == 1 else (label_len,)
    spec = {"label": tf.io.FixedLenFeature(label_shape, label_dtype)}
    if "image" in features:
        key = "image"
        shape = tf.io.decode_image(features["image"].bytes_list.value[0], expand_animations=False).shape
        channels, size = shape[-1], image_folders.parse_image_size(image_size)
        shape = (*size, channels) if size else shape
        raw = None if size else tf.TensorSpec(shape, tf.uint8)

        def to_features(value):  # uint8 (normalised by the caller), or float [0, 1] when resized
            image = tf.io.decode_image(value, channels=channels, expand_animations=False)
            return tf.ensure_shape(image_folders.to_float_image(image, size) if size else image, shape)

        to_features_batch = _one_by_one(to_features, shape, tf.float32 if size else tf.uint8)  # one image per call
    elif image_size:
        raise UserError(
            f"--image_size={image_size}: the records of {path} hold 'x' tensors, not encoded images; drop --image_size"
        )
    else:
        key = "x"
        first = features["x"].bytes_list.value[0]
        proto = tensor_pb2.TensorProto.FromString(first)
        dtype, shape = tf.as_dtype(proto.dtype), [d.size for d in proto.tensor_shape.dim]
        raw = tf.TensorSpec(shape, dtype)

        def to_features(value):
            return tf.ensure_shape(tf.io.parse_tensor(value, dtype), shape)

        to_features_batch = _serialized_tensors_decoder(path, first, proto, dtype, shape, to_features)
    spec[key] = tf.io.FixedLenFeature((), tf.string)

    def decode(serialized):
        parsed = tf.io.parse_single_example(serialized, spec)
        return normalise_features(to_features(parsed[key]), batched=False, on_cpu=True), normalise_labels(
            parsed["label"]
        )

    def decode_batch(serialized):
        parsed = tf.io.parse_example(serialized, spec)
        return normalise_features(to_features_batch(parsed[key]), on_cpu=True), normalise_labels(parsed["label"])

    return decode, decode_batch, spec, raw


def _serialized_tensors_decoder(path, first: bytes, proto, dtype, shape, to_features):
    """A batch of tf.io.serialize_tensor strings -> one (batch, *shape) tensor. Tensors of one dtype
    and shape serialize to the same header followed by their raw bytes, so the batch is sliced and
    decoded in two vectorised ops; every record's header is checked against the first record's (a
    record of another dtype or shape fails naming the file of the first). Falls back to one
    parse_tensor per record where the bytes are not stored raw."""
    size = int(np.prod(shape, dtype=np.int64)) * dtype.size
    if not proto.tensor_content or dtype not in _RAW_DTYPES or len(first) <= size:
        return _one_by_one(to_features, shape, dtype)
    header = first[: len(first) - size]

    def to_features_batch(values):
        same = tf.reduce_all(tf.equal(tf.strings.substr(values, 0, len(header)), header)) & tf.reduce_all(
            tf.equal(tf.strings.length(values), len(first))
        )
        check = tf.debugging.Assert(
            same, [f"{path}: a record's 'x' is not a {dtype.name} tensor of shape {shape} like the first record's"]
        )
        with tf.control_dependencies([check]):
            flat = tf.io.decode_raw(tf.strings.substr(values, len(header), size), dtype)
        return tf.reshape(flat, [-1, *shape])

    return to_features_batch


def _one_by_one(to_features, shape, dtype):
    """A batch decoder that calls the one-record decoder `to_features` on each record."""
    return lambda values: tf.map_fn(to_features, values, fn_output_signature=tf.TensorSpec(shape, dtype))


# Dtypes whose serialized tensors hold their raw bytes (tensor_content), which decode_raw reads.
_RAW_DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64)


_SCAN_BATCH = 4096  # records read and parsed at a time by the start-up check
_READ_ERRORS = (tf.errors.DataLossError, tf.errors.InvalidArgumentError, tf.errors.OutOfRangeError)


def _scan(files, spec=None) -> tuple:
    """(records, lowest label, highest label) over `files` in ONE pass that reads each record's bytes
    and, with `spec` (the default schema's features), parses them (the label range only for integer
    labels; None, None without); the first bad record is a UserError naming its file, index, byte
    offset and cause."""
    count, low, high = 0, None, None
    for path in files:
        problem, records, labels = scan_file(path, spec)
        if problem:
            raise UserError(problem)
        count += records
        if labels is not None:
            low = labels[0] if low is None else min(low, labels[0])
            high = labels[1] if high is None else max(high, labels[1])
    return count, low, high


def scan_file(path, spec=None, decode_batch=None) -> tuple:
    """(problem or None, records, (lowest, highest) integer label or None) of one file: every record
    read (its framing and CRCs checked) and, with `spec`, parsed, with `decode_batch` also decoded
    as training decodes it, `_SCAN_BATCH` at a time; a problem is 'FILE: record N (byte B): cause'.
    Nothing per record unless a batch fails."""
    path = path.decode() if isinstance(path, bytes) else str(path)
    integer = spec is not None and spec["label"].dtype == tf.int64
    count, offset, low, high = 0, 0, None, None
    batches = iter(tf.data.TFRecordDataset(path).batch(_SCAN_BATCH))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return None, count, None if low is None else (low, high)
        except _READ_ERRORS + (UnicodeDecodeError,) as err:
            return _unreadable(path, count, offset, err), count, None
        lengths = tf.strings.length(batch).numpy() + bad_records.RECORD_OVERHEAD
        if spec is not None:
            try:
                labels = tf.io.parse_example(batch, spec)["label"].numpy()
            except (tf.errors.InvalidArgumentError, UnicodeDecodeError):
                parse = functools.partial(tf.io.parse_example, features=spec)
                return _first_failing(path, batch, count, offset, lengths, parse), count, None
            if integer and labels.size:
                low = int(labels.min()) if low is None else min(low, int(labels.min()))
                high = int(labels.max()) if high is None else max(high, int(labels.max()))
        if decode_batch is not None:
            try:
                decode_batch(batch)
            except (tf.errors.InvalidArgumentError, UnicodeDecodeError):
                return _first_failing(path, batch, count, offset, lengths, decode_batch), count, None
        count, offset = count + len(lengths), offset + int(lengths.sum())
    return None


def _unreadable(path, start: int, offset: int, err) -> str:
    """The record at or after `start` (byte `offset`) that could not be read: its index and the byte
    where it starts counted one record at a time (TensorFlow's "corrupted record at B" names its data's byte)."""
    index = start
    try:
        for record in tf.data.TFRecordDataset(path).skip(start):
            offset += len(record.numpy()) + bad_records.RECORD_OVERHEAD
            index += 1
    except _READ_ERRORS + (UnicodeDecodeError,) as again:
        err = again
    return f"{path}: record {index} (byte {offset}): {bad_records.first_cause(err)}"


def _first_failing(path, batch, start: int, offset: int, lengths, run) -> str:
    """The first record of `batch` (records `start`... of `path`, from byte `offset`) on which `run`
    (a function of a batch of records) fails, tried one record at a time."""
    for i, record in enumerate(batch):
        try:
            run(record[None])
        except (tf.errors.InvalidArgumentError, UnicodeDecodeError) as err:
            where = offset + int(lengths[:i].sum())
            return f"{path}: record {start + i} (byte {where}): {bad_records.first_cause(err)}"
    return f"{path}: records {start}-{start + len(lengths) - 1} (from byte {offset}) fail together, not one by one"


def _decode_checker(decode):
    """check(path) for a Task's parse_example: each record decoded (the error path only: per record)."""

    def check(path):
        path = path.decode() if isinstance(path, bytes) else str(path)
        problem, _, _ = scan_file(path)
        if problem:
            return problem
        offset = 0
        for index, record in enumerate(tf.data.TFRecordDataset(path)):
            try:
                decode(record)
            except (tf.errors.InvalidArgumentError, UnicodeDecodeError) as err:
                return f"{path}: record {index} (byte {offset}): {bad_records.first_cause(err)}"
            offset += len(record.numpy()) + bad_records.RECORD_OVERHEAD
        return None

    return check


def load(argument: str, config, parse_example=None) -> streams.StreamSource:
    """`argument` is TRAIN_GLOB[,TEST_GLOB]; without TEST_GLOB the train files serve both splits."""
    train_glob, _, test_glob = argument.partition(",")
    train_files = _files(train_glob, "train")
    test_files = _files(test_glob, "test") if test_glob else train_files
    where = f"TFRecords {train_glob}" + (f" (test {test_glob})" if test_glob else " (also the test split)")
    num_classes = config.num_classes or None
    features = raw = decode_batch = None  # a Task's parse_example: its raw form is the Task's own
    if parse_example is not None:
        if config.image_size:
            raise UserError(
                f"--image_size={config.image_size}: the Task's parse_example decodes {where}; "
                "resize there, or drop --image_size"
            )
        decode = parse_example
        check = _decode_checker(parse_example)
    else:
        decode, decode_batch, features, raw = _default_schema(train_files[0], config.image_size)

        def check(path):
            return scan_file(path, features, decode_batch)[0]

    train_scan = _scan(train_files, features)
    test_scan = _scan(test_files, features) if test_glob else train_scan
    num_train, num_test = train_scan[0], test_scan[0]
    if train_scan[1] is not None and test_scan[1] is not None:  # integer labels
        num_classes = num_classes or max(train_scan[2], test_scan[2]) + 1
        for split, (_, low, high) in zip(("train", "test"), (train_scan, test_scan)):
            if low < 0 or high >= num_classes:
                raise UserError(f"{where}: {split} labels range over [{low}, {high}], expected [0, {num_classes - 1}]")
    element = tf.data.TFRecordDataset(train_files[:1]).map(decode).element_spec
    check_example_pair("--dataset=tfrecord: the Task's parse_example", element)
    spec = DataSpec.of(element, num_classes if element[1].dtype.is_integer else None, raw_features=raw)
    if spec.features.shape.num_elements() is None:
        raise UserError(
            f"{where}: features have an unknown shape {spec.features.shape}; every example "
            "must have the same shape (resize images when writing them, or in parse_example)"
        )
    return streams.StreamSource(
        name=f"tfrecord:{argument}",
        where=where,
        train_units=train_files,
        test_units=test_files,
        read=tf.data.TFRecordDataset,
        decode=decode,
        decode_batch=decode_batch,
        spec=spec,
        num_train=streams.check_not_empty(where, "train", num_train),
        num_test=streams.check_not_empty(where, "test", num_test),
        shuffle_buffer=config.shuffle_buffer,
        cache=config.cache,
        check=check,
    )


# ---- writing the default schema ----
def _bytes(value: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def example(features: np.ndarray, label, encode_png: bool) -> bytes:
    """One record of the default schema: PNG-encoded uint8 images, else the serialized tensor."""
    label = np.asarray(label).reshape(-1)
    entry = {
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=label.tolist()))
        if np.issubdtype(label.dtype, np.integer)
        else tf.train.Feature(float_list=tf.train.FloatList(value=label.tolist()))
    }
    if encode_png:
        image = features if features.ndim == 3 else features[..., None]
        entry["image"] = _bytes(tf.io.encode_png(image).numpy())
    else:
        entry["x"] = _bytes(tf.io.serialize_tensor(tf.constant(features)).numpy())
    return tf.train.Example(features=tf.train.Features(feature=entry)).SerializeToString()


def write_shards(directory: str, split: str, x: np.ndarray, y: np.ndarray, shards: int, png: bool = True) -> list:
    """Writes x, y as `shards` files DIR/SPLIT-00000-of-0000N.tfrecord (examples dealt round-robin).
    uint8 images are PNG-encoded ("image") unless `png` is False; everything else is stored as a
    serialized tensor ("x"), which is larger on disk but several times cheaper to decode."""
    os.makedirs(directory, exist_ok=True)
    encode_png = png and x.dtype == np.uint8 and x.ndim in (3, 4) and (x.ndim == 3 or x.shape[-1] in (1, 3, 4))
    paths = [os.path.join(directory, f"{split}-{i:05d}-of-{shards:05d}.tfrecord") for i in range(shards)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    try:
        for i in range(len(x)):
            writers[i % shards].write(example(x[i], y[i], encode_png))
    finally:
        for writer in writers:
            writer.close()
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Write an npz (x_train, y_train, x_test, y_test) as TFRecord shards of the engine's default schema."
    )
    parser.add_argument("--npz", required=True, help="input .npz with x_train, y_train, x_test, y_test")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--shards", type=int, default=8, help="files per split (default 8)")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="store uint8 images as serialized tensors, not PNG (bigger, faster to decode)",
    )
    args = parser.parse_args(argv)
    with np.load(args.npz) as arrays:
        for split in ("train", "test"):
            paths = write_shards(
                args.out, split, arrays[f"x_{split}"], arrays[f"y_{split}"], args.shards, png=not args.raw
            )
            print(f"{split}: {len(arrays[f'x_{split}'])} examples in {len(paths)} files {paths[0]} ...")


if __name__ == "__main__":
    main()
