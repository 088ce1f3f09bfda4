"""Data sources: where the arrays come from (built-in names, local files, generated), validated.

A source gives an `ArrayData`: train and test arrays plus what the Task needs to know of them.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from engine.config import DATASETS
from engine.data import readers
from engine.errors import UserError

DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


@dataclasses.dataclass(frozen=True)
class ArrayData:
    """A whole dataset in memory: uint8 images (N, H, W) and integer labels (N,)."""

    name: str
    source: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int = 10

    @property
    def image_shape(self) -> tuple:
        return tuple(self.train_images.shape[1:]) + (1,)


def load(config) -> ArrayData:
    """Loads `config.dataset` (one of DATASETS) and validates it."""
    if config.dataset not in DATASETS:
        raise UserError(f"unknown --dataset={config.dataset!r}; valid: {', '.join(DATASETS)}")
    if config.data_dir is not None and not os.path.isdir(config.data_dir):
        raise UserError(f"--data_dir={config.data_dir} is not a directory")
    loader = {"mnist": _load_mnist, "fashion_mnist": _load_fashion_mnist, "synthetic": _load_synthetic}
    data = loader[config.dataset](config)
    validate(data)
    return data


def validate(data: ArrayData) -> None:
    for split in ("train", "test"):
        images = getattr(data, f"{split}_images")
        labels = getattr(data, f"{split}_labels")
        if images.ndim != 3:
            raise UserError(
                f"{data.source}: {split} images have shape {images.shape}, expected (N, height, width)"
            )
        if images.shape[1:] != data.train_images.shape[1:]:
            raise UserError(
                f"{data.source}: test images are {images.shape[1:]}, train images {data.train_images.shape[1:]}"
            )
        if labels.shape != (len(images),):
            raise UserError(
                f"{data.source}: {split} labels have shape {labels.shape}, expected ({len(images)},)"
            )
        if len(images) == 0:
            raise UserError(f"{data.source}: the {split} split is empty")
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= data.num_classes:
            raise UserError(
                f"{data.source}: {split} labels range over [{low}, {high}], expected [0, {data.num_classes - 1}]"
            )


def _from_idx_dir(name: str, directory: str) -> ArrayData:
    train = readers.read_idx_split(directory, "train")
    test = readers.read_idx_split(directory, "test")
    return ArrayData(name, directory, *train, *test)


def _from_npz(name: str, path: str) -> ArrayData:
    arrays = readers.read_mnist_npz(path)
    return ArrayData(name, path, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"])


def _keras_cache_dir() -> str:
    return os.path.join(os.environ.get("KERAS_HOME", os.path.expanduser("~/.keras")), "datasets")


def _keras_download(name: str, config) -> ArrayData:
    """Keras' own download; with no network, a UserError naming the files and the alternatives."""
    import keras

    try:
        module = keras.datasets.mnist if name == "mnist" else keras.datasets.fashion_mnist
        (x_train, y_train), (x_test, y_test) = module.load_data()
    except Exception as err:  # Keras raises bare Exceptions for network failures.
        files = "mnist.npz" if name == "mnist" else "train-images-idx3-ubyte.gz and the 3 other IDX files"
        raise UserError(
            f"--dataset={name}: no local files and the Keras download failed "
            f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}); "
            f"place {files} in --data_dir (or {_keras_cache_dir()}), "
            "or use --dataset=fashion_mnist (Debian package dataset-fashion-mnist) or --dataset=synthetic"
        ) from None
    return ArrayData(name, "keras download", x_train, y_train, x_test, y_test)


def _load_local(name: str, directories, npz_name: str | None) -> ArrayData | None:
    for directory in directories:
        if directory is None:
            continue
        if npz_name and os.path.isfile(os.path.join(directory, npz_name)):
            return _from_npz(name, os.path.join(directory, npz_name))
        if readers.has_idx_files(directory):
            return _from_idx_dir(name, directory)
    return None


def _load_mnist(config) -> ArrayData:
    if config.data_dir is not None:
        data = _load_local("mnist", [config.data_dir], "mnist.npz")
        if data is None:
            raise UserError(
                f"--data_dir={config.data_dir} holds neither mnist.npz nor the 4 MNIST IDX files "
                "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
                "t10k-labels-idx1-ubyte.gz)"
            )
        return data
    return _load_local("mnist", [_keras_cache_dir()], "mnist.npz") or _keras_download("mnist", config)


def _load_fashion_mnist(config) -> ArrayData:
    if config.data_dir is not None:
        data = _load_local("fashion_mnist", [config.data_dir], None)
        if data is None:
            raise UserError(
                f"--data_dir={config.data_dir} lacks the 4 Fashion-MNIST IDX files "
                "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
                "t10k-labels-idx1-ubyte.gz)"
            )
        return data
    local = _load_local("fashion_mnist", [DEBIAN_FASHION_MNIST_DIR], None)
    return local or _keras_download("fashion_mnist", config)


def synthetic_arrays(num_examples: int, seed: int, num_classes: int = 10, size: int = 28):
    """MNIST-shaped uint8 images whose label is decided by their pixels (learnable), deterministic.

    Each class has a fixed random template of bright blobs; an image is its class's template,
    shifted by up to 2 pixels each way, plus strong noise, so a model needs a few hundred steps.
    """
    templates = np.random.default_rng(20240601).random((num_classes, size, size)) > 0.85
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_examples).astype(np.uint8)
    shifts = rng.integers(-2, 3, size=(num_examples, 2))
    images = np.empty((num_examples, size, size), dtype=np.float32)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            chosen = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            images[chosen] = np.roll(templates, (dy, dx), axis=(1, 2))[labels[chosen]] * 120.0
    images += rng.normal(40.0, 60.0, size=images.shape).astype(np.float32)
    return np.clip(images, 0, 255).astype(np.uint8), labels


def _load_synthetic(config) -> ArrayData:
    train = synthetic_arrays(config.synthetic_train_examples, seed=1)
    test = synthetic_arrays(config.synthetic_test_examples, seed=2)
    return ArrayData("synthetic", "synthetic (generated in memory)", *train, *test)
