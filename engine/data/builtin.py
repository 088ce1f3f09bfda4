"""The built-in in-memory sources: `mnist`, `fashion_mnist`, `synthetic`, and `npz:PATH`.

Each loader takes the run's Config and returns an `ArraySource`. The MNIST-shaped sets are looked
up locally first (--data_dir, the Keras cache, Debian's Fashion-MNIST package), then through Keras'
download; offline and without files the error names the files to provide.
"""

from __future__ import annotations

import os

import numpy as np

from engine.data import readers
from engine.data.arrays import ArraySource
from engine.data.formats import parse_shape
from engine.errors import UserError

DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# Label i's name (Fashion-MNIST's README); MNIST's labels are their own names.
CLASS_NAMES = {
    "fashion_mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    )
}


def load_npz(path: str, config) -> ArraySource:
    arrays = readers.read_npz(path)
    return ArraySource(
        f"npz:{path}",
        path,
        arrays["x_train"],
        arrays["y_train"],
        arrays["x_test"],
        arrays["y_test"],
        num_classes=config.num_classes or None,
    )


def _from_idx_dir(name: str, directory: str) -> ArraySource:
    train = readers.read_idx_split(directory, "train")
    test = readers.read_idx_split(directory, "test")
    return _ten_classes(name, directory, *train, *test)


def _ten_classes(name, where, x_train, y_train, x_test, y_test) -> ArraySource:
    """MNIST-shaped data: (N, 28, 28) uint8 images, labels in [0, 10)."""
    for split, x in (("train", x_train), ("test", x_test)):
        if x.ndim != 3:
            raise UserError(f"{where}: {split} images have shape {x.shape}, expected (N, height, width)")
    return ArraySource(name, where, x_train, y_train, x_test, y_test, num_classes=10, class_names=CLASS_NAMES.get(name))


def _from_npz(name: str, path: str) -> ArraySource:
    arrays = readers.read_npz(path, what="a Keras mnist.npz")
    return _ten_classes(name, path, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"])


def _keras_cache_dir() -> str:
    return os.path.join(os.environ.get("KERAS_HOME", os.path.expanduser("~/.keras")), "datasets")


def _keras_download(name: str, config) -> ArraySource:
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
    return _ten_classes(name, "keras download", x_train, y_train, x_test, y_test)


def _load_local(name: str, directories, npz_name: str | None) -> ArraySource | None:
    for directory in directories:
        if directory is None:
            continue
        if npz_name and os.path.isfile(os.path.join(directory, npz_name)):
            return _from_npz(name, os.path.join(directory, npz_name))
        if readers.has_idx_files(directory):
            return _from_idx_dir(name, directory)
    return None


def load_mnist(config) -> ArraySource:
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


def load_fashion_mnist(config) -> ArraySource:
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


def synthetic_arrays(num_examples: int, seed: int, num_classes: int = 10, shape=(28, 28)):
    """uint8 examples of `shape` whose label is decided by their values (learnable), deterministic.

    Each class has a fixed random template of bright blobs; an example is its class's template,
    shifted by up to 2 places along its first two axes, plus strong noise, so a model needs a few
    hundred steps. (28, 28) gives MNIST-shaped grey images; (32, 32, 3) colour ones.

    Built SYNTHETIC_CHUNK examples at a time (the same random stream, so the same bytes as one
    pass): one pass over all the examples made float64 noise and float32 image arrays several times
    the size of the result, and faulting those pages in cost about as much as drawing the noise, a
    visible part of a fresh process's start-up (docs/performance.md, the first finished loop).
    """
    shape = tuple(shape)
    templates = np.random.default_rng(20240601).random((num_classes, *shape)) > 0.85
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_examples).astype(np.uint8)
    axes = tuple(range(1, min(len(shape), 2) + 1))
    shifts = rng.integers(-2, 3, size=(num_examples, 2))
    if len(axes) == 1:
        shifts[:, 1] = 0
    # bright[5 * (dy + 2) + (dx + 2), label]: the label's template shifted by (dy, dx), as 0 or 120.
    bright = np.stack(
        [np.roll(templates, (dy, dx)[: len(axes)], axis=axes) for dy in range(-2, 3) for dx in range(-2, 3)]
    ).astype(np.float32) * np.float32(120.0)
    shift_index = 5 * (shifts[:, 0] + 2) + (shifts[:, 1] + 2)
    images = np.empty((num_examples, *shape), dtype=np.uint8)
    for start in range(0, num_examples, SYNTHETIC_CHUNK):
        stop = min(start + SYNTHETIC_CHUNK, num_examples)
        part = bright[shift_index[start:stop], labels[start:stop]]
        part += rng.normal(40.0, 60.0, size=part.shape).astype(np.float32)
        images[start:stop] = np.clip(part, 0, 255)
    return images, labels


SYNTHETIC_CHUNK = 2048  # examples per pass of synthetic_arrays: small temporaries, reused pages


def load_synthetic(config) -> ArraySource:
    classes = config.num_classes or 10
    shape = parse_shape(config.synthetic_shape, "synthetic_shape")
    train = synthetic_arrays(config.synthetic_train_examples, seed=1, num_classes=classes, shape=shape)
    test = synthetic_arrays(config.synthetic_test_examples, seed=2, num_classes=classes, shape=shape)
    return ArraySource("synthetic", "synthetic (generated in memory)", *train, *test, num_classes=classes)
