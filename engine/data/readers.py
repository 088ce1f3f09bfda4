"""File readers: IDX (`*-idx3-ubyte[.gz]`) and npz archives (Keras' `mnist.npz`). Pure NumPy, no TensorFlow.

Every malformed file is a UserError naming the file and what is wrong with it.
"""

from __future__ import annotations

import gzip
import os
import zipfile

import numpy as np

from engine.errors import UserError

# IDX type codes (third byte of the magic number) -> numpy dtype, big-endian as the format says.
_IDX_TYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

IDX_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _read_bytes(path: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise UserError(f"cannot read {path}: {err}") from None


def read_idx(path: str, expected_ndim: int | None = None) -> np.ndarray:
    """Reads one IDX file, checking its magic number, dimensions and size."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise UserError(f"{path}: {len(data)} bytes is too short for an IDX header")
    zero1, zero2, type_code, ndim = data[0], data[1], data[2], data[3]
    if zero1 or zero2 or type_code not in _IDX_TYPES:
        raise UserError(
            f"{path}: bad IDX magic number 0x{data[:4].hex()} (expected 0x0000080{ndim} for unsigned bytes)"
        )
    if expected_ndim is not None and ndim != expected_ndim:
        raise UserError(f"{path}: IDX file has {ndim} dimensions, expected {expected_ndim}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UserError(f"{path}: truncated IDX header ({len(data)} bytes, need {header})")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_TYPES[type_code]
    expected = int(np.prod(shape)) * dtype.itemsize
    actual = len(data) - header
    if actual != expected:
        kind = "truncated" if actual < expected else "too long"
        raise UserError(f"{path}: {kind}: header says shape {shape} ({expected} bytes of data), file has {actual}")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def find_idx_file(directory: str, stem: str) -> str | None:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def has_idx_files(directory: str) -> bool:
    return all(find_idx_file(directory, stem) for pair in IDX_SPLIT_FILES.values() for stem in pair)


def read_idx_split(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, H, W) and labels (N,) of `split` ('train' or 'test') from an IDX directory."""
    image_stem, label_stem = IDX_SPLIT_FILES[split]
    paths = []
    for stem in (image_stem, label_stem):
        path = find_idx_file(directory, stem)
        if path is None:
            raise UserError(f"missing {stem}.gz (or {stem}) in {directory}")
        paths.append(path)
    images = read_idx(paths[0], expected_ndim=3)
    labels = read_idx(paths[1], expected_ndim=1)
    if len(images) != len(labels):
        raise UserError(f"{directory}: {split} split has {len(images)} images but {len(labels)} labels")
    return images, labels


def read_npz(path: str, what: str = "an npz data set") -> dict[str, np.ndarray]:
    """Arrays x_train, y_train, x_test, y_test (Keras' mnist.npz has exactly these)."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file (expected {what} with arrays x_train, y_train, x_test, y_test)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = {"x_train", "y_train", "x_test", "y_test"} - set(npz.files)
            if missing:
                raise UserError(f"{path}: not {what}, missing arrays {sorted(missing)} (it has {sorted(npz.files)})")
            return {k: npz[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise UserError(f"cannot read {path} as a .npz file: {err}") from None
