"""`--dataset=images:DIR`: JPEG and PNG files in one sub-folder per class, streamed.

Two layouts:
  DIR/train/<class>/*.png|*.jpg|*.jpeg  and  DIR/test/<class>/...   the two splits as given; or
  DIR/<class>/...  with --validation_split=F (0 < F < 1)            the engine holds out about F.
A class is a sub-folder (searched recursively for images; other files and hidden entries are
ignored). Classes are sorted by name and numbered 0..K-1 from the training folders; the test split
uses the same numbers, and a test class that training lacks is an error.

--validation_split: within each class the files are ordered by a SHA-256 hash of their path relative
to DIR and the first round(F x n) of them (halves up; at least 1 and at most n-1 when the class has
2 or more files) are the test split. Nothing is random: every worker, every resume and every copy of
DIR at another path agrees, and adding a file moves at most one other file of its class between the
splits.

Each example is decoded with tf.io.decode_image to a fixed channel count: 3 (colour) unless the
first file of every class is grey, then 1 (grey files in a colour set are expanded, colour files in
a grey set converted). --image_size=H,W resizes (bilinear) to H x W; without it every image must
already have the size of the first one. Pixels become float32 in [0, 1]; labels int32.

Checks at start-up: the folders (DIR, class folders, images in each), and the first file of every
class in each split is decoded, so an unreadable or mismatched one names its file. The other files
are read while training (decoding every file at start-up would cost a whole epoch of decoding
before the first step): a file that is not a PNG or JPEG (by its first bytes), or whose size
differs without --image_size, stops the run with an InvalidArgumentError that names the file; a
file with a valid header but a corrupt body fails inside decode_image, whose message does not. To
check every file before a long run (it only decodes, no training):
  python -m engine.data.image_folders DIR [--image_size=H,W]
lists each file that does not decode (or, without --image_size, has another size) and exits 1.

A record is (path, label): the pipeline's shuffle buffer and the skip on resume handle paths only,
and the file is read when it is decoded (in parallel). With --cache the records hold the files'
bytes too, so the second and later passes read nothing from disk.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np
import tensorflow as tf

from engine.data import bad_records, streams
from engine.data.formats import parse_shape
from engine.data.spec import DataSpec
from engine.errors import UserError

EXTENSIONS = (".png", ".jpg", ".jpeg")
_MAGIC = (b"\x89PNG", b"\xff\xd8\xff")  # the first bytes of a PNG, of a JPEG


def _class_folders(directory: str) -> list[str]:
    return sorted(
        name
        for name in os.listdir(directory)
        if not name.startswith(".") and os.path.isdir(os.path.join(directory, name))
    )


def _images_in(folder: str) -> list[str]:
    """The image files below `folder`, sorted by their path relative to it."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if not f.startswith(".") and f.lower().endswith(EXTENSIONS)]
    return sorted(found, key=lambda path: os.path.relpath(path, folder))


def _scan(directory: str) -> dict[str, list[str]]:
    """{class name: its image files} of a folder of class folders."""
    classes = _class_folders(directory)
    if not classes:
        raise UserError(
            f"{directory} holds no class folders (--dataset=images:DIR expects "
            "DIR/<class>/*.png|jpg, or DIR/train/<class>/... and DIR/test/<class>/...)"
        )
    files = {}
    for name in classes:
        files[name] = _images_in(os.path.join(directory, name))
        if not files[name]:
            raise UserError(f"class folder {os.path.join(directory, name)} holds no images ({', '.join(EXTENSIONS)})")
    return files


def _units(files: dict, class_ids: dict) -> tuple:
    paths = [path for name in files for path in files[name]]
    labels = [class_ids[name] for name in files for _ in files[name]]
    return np.array(paths), np.array(labels, np.int32)


def split_by_hash(files: dict, fraction: float, root: str) -> tuple[dict, dict]:
    """({class: train files}, {class: test files}): per class, the files whose path (relative to
    `root`) hashes first form the test split, round(fraction x n) of them, 1 <= that <= n-1 for n >= 2."""
    train, test = {}, {}
    for name, paths in files.items():
        ordered = sorted(
            paths, key=lambda p: hashlib.sha256(os.path.relpath(p, root).replace(os.sep, "/").encode()).hexdigest()
        )
        held = min(max(int(fraction * len(paths) + 0.5), 1), len(paths) - 1) if len(paths) > 1 else 0
        test[name] = sorted(ordered[:held])
        train[name] = sorted(ordered[held:])
    return train, {name: paths for name, paths in test.items() if paths}


def _layout(directory: str, config) -> tuple[dict, dict, str]:
    """({class: train files}, {class: test files}, where) of DIR as the flags say."""
    if not os.path.isdir(directory):
        raise UserError(f"--dataset=images:{directory}: no such directory")
    split = config.validation_split
    if not 0 <= split < 1:
        raise UserError(
            f"--validation_split={split}: expected a fraction with 0 < F < 1 (0: use DIR/train and DIR/test)"
        )
    train_dir, test_dir = os.path.join(directory, "train"), os.path.join(directory, "test")
    if os.path.isdir(train_dir) or os.path.isdir(test_dir):
        if split:
            raise UserError(
                f"--validation_split={split} with {directory}/train and /test: the test split is "
                "given; drop --validation_split, or point DIR at one folder of class folders"
            )
        if not (os.path.isdir(train_dir) and os.path.isdir(test_dir)):
            present, missing = (train_dir, test_dir) if os.path.isdir(train_dir) else (test_dir, train_dir)
            raise UserError(
                f"--dataset=images:{directory} has {present} but no {missing}; give both, or "
                "one folder of class folders with --validation_split=F"
            )
        train, test = _scan(train_dir), _scan(test_dir)
        unknown = sorted(set(test) - set(train))
        if unknown:
            raise UserError(f"{test_dir} has class folders that {train_dir} lacks: {', '.join(unknown)}")
        return train, test, f"{train_dir} (test {test_dir})"
    files = _scan(directory)
    if not split:
        raise UserError(
            f"--dataset=images:{directory} has class folders but no train/ and test/ folders; "
            "pass --validation_split=F (e.g. 0.1) to hold out that fraction for evaluation"
        )
    train, test = split_by_hash(files, split, directory)
    return train, test, f"{directory} ({split:g} of each class held out for evaluation)"


def _first_image(path: str) -> tf.Tensor:
    try:
        with open(path, "rb") as f:
            contents = f.read()
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror})") from None
    if not contents.startswith(_MAGIC):
        raise UserError(f"{path}: not a PNG or JPEG image (its first bytes are {contents[:4]!r})")
    try:
        return tf.io.decode_image(contents, expand_animations=False)
    except tf.errors.InvalidArgumentError as err:
        raise UserError(f"{path}: corrupt image ({err.message.splitlines()[0][:120]})") from None


def parse_image_size(text: str) -> tuple | None:
    """--image_size "H,W" -> (H, W) pixels; "" -> None (keep the files' own size)."""
    if not text:
        return None
    size = parse_shape(text, "image_size")
    if len(size) != 2:
        raise UserError(f"--image_size={text!r}: expected HEIGHT,WIDTH in pixels, e.g. 64,64")
    return size


def to_float_image(image, size=None):
    """A decoded uint8 (height, width, channels) image -> float32 in [0, 1], resized (bilinear) to
    `size` (height, width) when given."""
    if size:
        return tf.image.resize(image, size) / 255.0
    return tf.cast(image, tf.float32) / 255.0


def _example_shape(train: dict, test: dict, image_size: str) -> tuple:
    """(height, width, channels) of every example, from the first file of each class and split."""
    firsts = [paths[0] for split in (train, test) for paths in split.values()]
    shapes = {path: tuple(_first_image(path).shape) for path in firsts}
    channels = 1 if all(shape[-1] in (1, 2) for shape in shapes.values()) else 3
    size = parse_image_size(image_size)
    if size:
        return (*size, channels)
    first, size = firsts[0], shapes[firsts[0]][:2]
    for path, shape in shapes.items():
        if shape[:2] != size:
            raise UserError(
                f"{path} is {shape[0]}x{shape[1]} pixels but {first} is {size[0]}x{size[1]}; "
                "images must share one size, or pass --image_size=H,W to resize them"
            )
    return (*size, channels)


def _decoder(shape: tuple, resize: bool):
    """(path, file contents) -> float32 image of `shape` in [0, 1]; a bad file's error names it."""
    height, width, channels = shape

    def decode(path, contents):
        header = tf.strings.substr(contents, 0, 4)
        known = tf.reduce_any([tf.strings.substr(header, 0, len(m)) == m for m in _MAGIC])
        with tf.control_dependencies([tf.debugging.Assert(known, ["not a PNG/JPEG image:", path])]):
            image = tf.io.decode_image(contents, channels=channels, expand_animations=False)
        if resize:
            image = to_float_image(image, (height, width))
        else:
            found = tf.shape(image)[:2]
            same = tf.reduce_all(found == (height, width))
            with tf.control_dependencies(
                [
                    tf.debugging.Assert(
                        same,
                        [
                            path,
                            "has height, width",
                            found,
                            f"but the images are {height}x{width}; pass --image_size=H,W to resize them",
                        ],
                    )
                ]
            ):
                image = to_float_image(image)
        return tf.ensure_shape(image, shape)

    return decode


def load(directory: str, config) -> streams.StreamSource:
    directory = directory.rstrip("/") or "/"
    train, test, where = _layout(directory, config)
    class_names = sorted(train)
    class_ids = {name: i for i, name in enumerate(class_names)}
    shape = _example_shape(train, test, config.image_size)
    to_image = _decoder(shape, resize=bool(config.image_size))
    if config.cache:  # records hold the bytes, so the cache keeps them

        def read(path, label):
            return tf.data.Dataset.from_tensors((path, tf.io.read_file(path), label))

        def decode(path, contents, label):
            return to_image(path, contents), label
    else:  # records are paths: shuffling and skipping on resume touch no file

        def read(path, label):
            return tf.data.Dataset.from_tensors((path, label))

        def decode(path, label):
            return to_image(path, tf.io.read_file(path)), label

    def check(path, label):  # one file decoded as training decodes it (engine/data/bad_records.py)
        path = path.decode() if isinstance(path, bytes) else str(path)
        try:
            to_image(tf.constant(path), tf.io.read_file(path))
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, UnicodeDecodeError) as err:
            return f"{path}: {bad_records.first_cause(err)}"
        return None

    train_units, test_units = _units(train, class_ids), _units(test, class_ids)
    # Served raw: the decoded uint8 image, which normalise_features maps as decode does; resized
    # images have no raw tensor form of one shape (the resize works on the file's own size).
    raw = None if config.image_size else tf.TensorSpec(shape, tf.uint8)
    spec = DataSpec.classification(shape, len(class_names), class_names, raw_features=raw)
    return streams.StreamSource(
        name=f"images:{directory}",
        where=where,
        train_units=train_units,
        test_units=test_units,
        read=read,
        decode=decode,
        spec=spec,
        num_train=streams.check_not_empty(where, "train", len(train_units[0])),
        num_test=streams.check_not_empty(where, "test", len(test_units[0])),
        shuffle_buffer=config.shuffle_buffer,
        cache=config.cache,
        check=check,
    )


# ---- checking every file ----
def bad_files(directory: str, image_size: str = "") -> list[str]:
    """'path: why' for every image below DIR's class folders (both splits) that does not decode, or,
    without `image_size`, whose height and width differ from the first file's."""
    parse_image_size(image_size)
    if not os.path.isdir(directory):
        raise UserError(f"{directory}: no such directory")
    splits = [os.path.join(directory, s) for s in ("train", "test") if os.path.isdir(os.path.join(directory, s))]
    paths = [p for root in splits or [directory] for files in _scan(root).values() for p in files]
    bad, size = [], None
    for path in paths:
        try:
            shape = tuple(_first_image(path).shape)
        except UserError as err:
            bad.append(err.message)
            continue
        size = size or (shape[:2], path)
        if not image_size and shape[:2] != size[0]:
            bad.append(f"{path} is {shape[0]}x{shape[1]} pixels but {size[1]} is {size[0][0]}x{size[0][1]}")
    return bad


def main(argv=None, out=sys.stdout) -> int:
    parser = argparse.ArgumentParser(
        description="Decode every image of an --dataset=images:DIR folder and list those that would stop a run."
    )
    parser.add_argument("directory", help="DIR of --dataset=images:DIR")
    parser.add_argument("--image_size", default="", help="H,W as the run will use it (then sizes may differ)")
    args = parser.parse_args(argv)
    try:
        bad = bad_files(args.directory, args.image_size)
    except UserError as err:
        out.write(f"error: {err.message}\n")
        return 2
    out.write("".join(f"{line}\n" for line in bad) + f"{len(bad)} bad file{'' if len(bad) == 1 else 's'}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
