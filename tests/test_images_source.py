"""--dataset=images:DIR: class folders of PNG files the tests write themselves (spec and class names,
labels from folder names, --image_size, --validation_split, training on 2 replicas, eval of every
file once, class names in config.json and TensorBoard, the flags) and every bad input."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from absl import flags as absl_flags

from helpers import QUIET, run_cli, small_config, stream_eval_totals, tensorboard_run
from engine.config import Config
from engine.controller.trainer import train
from engine.data import image_folders, sources, tfrecord
from engine.errors import UserError
from flags.definitions import config_from_flags, define_flags
from tasks_data import IdCountingTask

NAMES = ("zebra", "ant", "moth")  # folder names; sorted: ant 0, moth 1, zebra 2
CLASS_ID = {name: i for i, name in enumerate(sorted(NAMES))}


def id_image(example_id: int, shape=(12, 10, 3)) -> np.ndarray:
    """A uint8 image that carries its id in pixel (0, 0): channel 0 = id // 256, channel 1 (or pixel
    (0, 1) of a grey image) = id % 256; the rest is noise seeded by the id."""
    image = np.random.default_rng(example_id).integers(0, 256, shape, dtype=np.uint8)
    image[0, 0, 0] = example_id // 256
    image[(0, 0, 1) if shape[-1] == 3 else (0, 1, 0)] = example_id % 256
    return image


def ids_of(images: np.ndarray) -> np.ndarray:
    """The ids of a batch of decoded [0, 1] images (inverse of id_image)."""
    pixels = np.round(np.asarray(images) * 255).astype(np.int64)
    low = pixels[:, 0, 0, 1] if pixels.shape[-1] == 3 else pixels[:, 0, 1, 0]
    return pixels[:, 0, 0, 0] * 256 + low


def write_folder(directory, ids, folder_of, shape=(12, 10, 3)) -> dict:
    """Writes image `id` as directory/<folder_of(id)>/img<id>.png; returns {id: class folder}."""
    written = {}
    for example_id in ids:
        folder = os.path.join(str(directory), folder_of(example_id))
        os.makedirs(folder, exist_ok=True)
        tf.io.write_file(
            os.path.join(folder, f"img{example_id:05d}.png"), tf.io.encode_png(id_image(example_id, shape))
        )
        written[example_id] = folder_of(example_id)
    return written


def by_id(example_id: int) -> str:
    return NAMES[example_id % 3]


def split_folders(root, n_train=30, n_test=11, shape=(12, 10, 3)) -> dict:
    """root/train/<class>/ (ids 0..n_train-1) and root/test/<class>/ (ids 1000...); {id: class}."""
    classes = write_folder(os.path.join(str(root), "train"), range(n_train), by_id, shape)
    classes.update(write_folder(os.path.join(str(root), "test"), range(1000, 1000 + n_test), by_id, shape))
    return classes


def all_examples(source, split: str):
    batches = list(source.test_batches(1000)) if split == "test" else [source.preview(source.num_train)]
    return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


# ---- what the source is ----
def test_spec_class_names_and_labels_follow_the_folders(tmp_path):
    classes = split_folders(tmp_path)
    source = sources.load(Config(dataset=f"images:{tmp_path}"))
    assert source.streamed and source.spec.is_image
    assert source.spec.input_shape == (12, 10, 3) and source.spec.features.dtype == tf.float32
    assert source.spec.num_classes == 3 and source.spec.class_names == ("ant", "moth", "zebra")
    assert (source.num_train, source.num_test) == (30, 11)
    for split, expected_ids in (("train", range(30)), ("test", range(1000, 1011))):
        x, y = all_examples(source, split)
        ids = ids_of(x)
        assert sorted(ids) == list(expected_ids)
        np.testing.assert_array_equal(y, [CLASS_ID[classes[i]] for i in ids])
        np.testing.assert_array_equal(x, np.stack([id_image(i) for i in ids]) / np.float32(255))
    assert "ant, moth, zebra" in source.spec.describe()


def test_image_size_resizes_and_grey_files_give_one_channel(tmp_path):
    write_folder(tmp_path / "train", range(12), by_id, shape=(12, 10, 1))
    write_folder(tmp_path / "test", range(100, 103), by_id, shape=(7, 9, 1))  # another size: resized too
    source = sources.load(Config(dataset=f"images:{tmp_path}", image_size="6,5"))
    assert source.spec.input_shape == (6, 5, 1)
    x, _ = next(source.test_batches(10))
    assert x.shape == (3, 6, 5, 1) and x.dtype == np.float32 and 0 <= x.min() and x.max() <= 1
    expected = tf.image.resize(id_image(100, (7, 9, 1)), (6, 5)).numpy() / 255
    np.testing.assert_allclose(x[0], expected, atol=1e-6)
    with pytest.raises(UserError, match="img00100.png is 7x9 pixels but .*img00001.png is 12x10"):
        sources.load(Config(dataset=f"images:{tmp_path}"))  # without --image_size the sizes must agree


def test_image_size_resizes_tfrecord_images_too(tmp_path):
    images = np.stack([id_image(i) for i in range(6)])
    source = sources.load(Config(dataset=_tfrecord(tmp_path, images), image_size="4,6"))
    assert source.spec.input_shape == (4, 6, 3)
    x, _ = next(source.test_batches(10))
    np.testing.assert_allclose(x, tf.image.resize(images, (4, 6)).numpy() / 255, atol=1e-6)


def test_jpeg_files_and_other_files_beside_them(tmp_path):
    split_folders(tmp_path, n_train=6, n_test=3)
    for i in range(3):  # JPEGs (.jpg, .JPEG) next to the PNGs; a text file and a hidden folder are ignored
        name = ("x.jpg", "y.JPEG", "z.jpg")[i]
        tf.io.write_file(os.path.join(str(tmp_path), "test", "moth", name), tf.io.encode_jpeg(id_image(i)))
    _garbage(os.path.join(str(tmp_path), "test", "moth", "notes.txt"))
    _garbage(os.path.join(str(tmp_path), "test", "moth", ".cache", "thumb.png"))
    source = sources.load(Config(dataset=f"images:{tmp_path}"))
    assert source.num_test == 6
    x, y = all_examples(source, "test")
    assert x.shape == (6, 12, 10, 3) and (y == CLASS_ID["moth"]).sum() == 4


def test_validation_split_is_deterministic_disjoint_and_complete(tmp_path):
    classes = write_folder(tmp_path / "a", range(41), by_id)  # ant 14, moth 13, zebra 14 files
    config = Config(dataset=f"images:{tmp_path / 'a'}", validation_split=0.25)
    source = sources.load(config)
    train_ids, test_ids = (ids_of(all_examples(source, split)[0]) for split in ("train", "test"))
    assert not set(train_ids) & set(test_ids) and sorted([*train_ids, *test_ids]) == list(range(41))
    assert sorted(classes[i] for i in test_ids) == sorted(["ant"] * 4 + ["moth"] * 3 + ["zebra"] * 4)
    assert source.num_test == 11 and source.num_train == 30
    again = sources.load(config)
    np.testing.assert_array_equal(again.test_units[0], source.test_units[0])
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")  # another path (another host): the same split
    moved = sources.load(config.replace(dataset=f"images:{tmp_path / 'elsewhere'}"))
    assert [os.path.relpath(p, tmp_path / "elsewhere") for p in moved.test_units[0]] == [
        os.path.relpath(p, tmp_path / "a") for p in source.test_units[0]
    ]
    # A new file moves at most one file of its class between the splits.
    write_folder(tmp_path / "a", [41], lambda _: "ant")
    grown = sources.load(config)
    assert len(set(source.test_units[0]) ^ set(grown.test_units[0])) <= 2


# ---- training and evaluation ----
def test_trains_on_two_replicas_and_records_class_names(tmp_path):
    split_folders(tmp_path / "data")
    config = small_config(
        tmp_path / "run",
        dataset=f"images:{tmp_path / 'data'}",
        strategy="mirrored",
        cpu_replicas=2,
        global_batch=8,
        train_steps=5,
        steps_per_loop=2,
        shuffle_buffer=16,
    )
    result = train(config, **QUIET)
    assert result.final_step == 5 and np.isfinite(result.eval_metrics["loss"])
    with open(tmp_path / "run" / "config.json") as f:
        record = json.load(f)
    assert record["class_names"] == ["ant", "moth", "zebra"]
    events = tensorboard_run(tmp_path / "run" / "eval")
    text = tf.make_ndarray(events.Tensors("class_names")[-1].tensor_proto).item().decode()
    assert "| 0 | ant | " in text and "| 2 | zebra | " in text
    wrong = tf.make_ndarray(events.Tensors("misclassified_labels")[-1].tensor_proto).item().decode()
    assert re.search(r"\d>\d \((ant|moth|zebra)>(ant|moth|zebra)\)", wrong), wrong  # noise images: some wrong
    # Resuming with the classes renamed would silently change what each label means: refused.
    os.rename(tmp_path / "data" / "train" / "moth", tmp_path / "data" / "train" / "bee")
    os.rename(tmp_path / "data" / "test" / "moth", tmp_path / "data" / "test" / "bee")
    with pytest.raises(UserError, match=r"trained on classes \[ant, moth, zebra\] but .* has \[ant, bee, zebra\]"):
        train(config.replace(train_steps=6), **QUIET)
    assert train(config.replace(train_steps=6, allow_config_change=True), **QUIET).start_step == 5
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["class_names"] == ["ant", "bee", "zebra"]  # the record follows the run


class PixelIdTask(IdCountingTask):
    """Sums the examples' ids, read back from their first pixel's first two channels."""

    @staticmethod
    def example_ids(x):
        pixels = tf.round(x[:, 0, 0, :2] * 255)
        return pixels[:, 0] * 256 + pixels[:, 1]


@pytest.mark.parametrize("replicas", [1, 2])
def test_eval_covers_every_file_once(tmp_path, replicas):
    split_folders(tmp_path, n_train=6, n_test=101)
    source = sources.load(Config(dataset=f"images:{tmp_path}"))
    assert stream_eval_totals(source, replicas, 16, PixelIdTask) == (101, sum(range(1000, 1101)))


def test_train_stream_with_cache_reads_every_file_once_per_epoch(tmp_path):
    split_folders(tmp_path, n_train=30, n_test=3)
    for cache in (False, True):
        source = sources.load(Config(dataset=f"images:{tmp_path}", cache=cache, shuffle_buffer=8))
        batches = source.train_dataset_fn(10, seed=3)(tf.distribute.InputContext(1, 0, 1)).take(6)
        ids = [ids_of(x.numpy()) for x, _ in batches]
        assert sorted(np.concatenate(ids[:3])) == list(range(30)) == sorted(np.concatenate(ids[3:]))


def test_two_workers_read_disjoint_files(tmp_path):
    split_folders(tmp_path, n_train=30, n_test=3)
    source = sources.load(Config(dataset=f"images:{tmp_path}", shuffle_buffer=8))
    assert "by FILE: 30 files over 2" in source.sharding(2)
    per_worker = []
    for pipeline in range(2):  # one epoch of each worker's share: 15 files, 5 per batch
        batches = source.train_dataset_fn(10, seed=3)(tf.distribute.InputContext(2, pipeline, 2)).take(3)
        per_worker.append(np.concatenate([ids_of(x.numpy()) for x, _ in batches]))
    assert not set(per_worker[0]) & set(per_worker[1])
    assert sorted(np.concatenate(per_worker)) == list(range(30))


def test_flags_reach_the_config(tmp_path):
    values = absl_flags.FlagValues()
    define_flags(values)
    values(["run.py", "--dataset=images:/data", "--image_size=64,48", "--validation_split=0.2"])
    config = config_from_flags(values)
    assert (config.dataset, config.image_size, config.validation_split) == ("images:/data", "64,48", 0.2)
    with pytest.raises(absl_flags.IllegalFlagValueError, match="validation_split"):
        values(["run.py", "--validation_split=1.5"])


def test_cli_run_with_validation_split(tmp_path):
    write_folder(tmp_path / "data", range(24), by_id)
    proc = run_cli(
        f"--dataset=images:{tmp_path / 'data'}",
        "--validation_split=0.25",
        "--image_size=8,8",
        "--global_batch=6",
        "--train_steps=2",
        "--model=mlp",
        "--seed=1",
        "--noexport",
        f"--model_dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "images:" in proc.stdout and "18 train / 6 test" in proc.stdout and "(ant, moth, zebra)" in proc.stdout
    with open(tmp_path / "run" / "config.json") as f:
        record = json.load(f)
    assert record["flags"]["image_size"] == "8,8" and record["flags"]["validation_split"] == 0.25
    assert record["class_names"] == ["ant", "moth", "zebra"]


# ---- bad input: one clear line each ----
def _garbage(path, data=b"this is not an image"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _folder(write):
    """A maker of images:ROOT for the test's tmp_path ROOT, after write(ROOT as str)."""

    def make(root):
        write(str(root))
        return f"images:{root}"

    return make


def _split_plus(write):
    """images:ROOT of split_folders(ROOT) plus what write(ROOT) adds."""
    return _folder(lambda root: (split_folders(root), write(root)))


def _corrupt_first_png(root):
    with open(os.path.join(root, "train", "ant", "img00001.png"), "r+b") as f:
        f.seek(20)  # keep the PNG signature, break the header chunk
        f.write(b"\x00" * 30)


def _tfrecord(root, x):
    tfrecord.write_shards(str(root), "train", x, np.arange(len(x)) % 3, 1)
    return f"tfrecord:{root}/train-*"


SPLIT = _split_plus(lambda root: None)
ONE_FOLDER = _folder(lambda root: write_folder(root, range(6), by_id))
BAD = [
    pytest.param(lambda p: f"images:{p / 'missing'}", {}, "no such directory", id="missing_dir"),
    pytest.param(
        _folder(lambda r: _garbage(f"{r}/x.png")),
        {"validation_split": 0.5},
        "holds no class folders",
        id="no_class_folders",
    ),
    pytest.param(
        _split_plus(lambda r: _garbage(f"{r}/train/bee/a.txt")),
        {},
        r"class folder .*train/bee holds no images",
        id="empty_class",
    ),
    pytest.param(
        _split_plus(lambda r: _garbage(f"{r}/train/ant/img00001.png")),
        {},
        r"train/ant/img00001.png: not a PNG or JPEG image",
        id="not_an_image",
    ),
    pytest.param(_split_plus(_corrupt_first_png), {}, r"train/ant/img00001.png: corrupt image", id="corrupt_png"),
    pytest.param(
        _split_plus(lambda r: write_folder(f"{r}/test", [5], lambda _: "bee")),
        {},
        r"test has class folders that .*train lacks: bee",
        id="unknown_test_class",
    ),
    pytest.param(
        _folder(lambda r: write_folder(f"{r}/train", range(6), by_id)),
        {},
        r"has .*train but no .*test",
        id="train_without_test",
    ),
    pytest.param(ONE_FOLDER, {}, "no train/ and test/ folders; pass --validation_split", id="no_split"),
    pytest.param(
        SPLIT, {"validation_split": 0.2}, r"--validation_split=0.2 with .*/train and /test", id="split_with_test_folder"
    ),
    pytest.param(
        ONE_FOLDER, {"validation_split": 1.5}, r"--validation_split=1.5: expected a fraction", id="split_too_large"
    ),
    pytest.param(
        ONE_FOLDER, {"validation_split": -0.1}, r"--validation_split=-0.1: expected a fraction", id="split_negative"
    ),
    pytest.param(SPLIT, {"image_size": "64"}, r"--image_size='64': expected HEIGHT,WIDTH", id="image_size_one_number"),
    pytest.param(SPLIT, {"image_size": "a,b"}, r"--image_size='a,b': expected positive", id="image_size_not_numbers"),
    pytest.param(SPLIT, {"num_classes": 5}, r"--num_classes=5 but .* has 3 classes", id="num_classes"),
    pytest.param(
        lambda p: "synthetic",
        {"image_size": "8,8"},
        r"--image_size=8,8 applies to --dataset=images:DIR and tfrecord: images only, not --dataset=synth",
        id="size_synthetic",
    ),
    pytest.param(
        lambda p: "npz:" + str(p / "missing.npz"),
        {"validation_split": 0.1},
        r"--validation_split=0.1 applies to --dataset=images:DIR only",
        id="split_npz",
    ),
    pytest.param(
        lambda p: _tfrecord(p, np.zeros((4, 3), np.float32)),
        {"image_size": "8,8"},
        r"--image_size=8,8: the records of .*train-00000-of-00001.tfrecord hold 'x' tensors",
        id="size_tfrecord_tensors",
    ),
]


@pytest.mark.parametrize("make, options, message", BAD)
def test_bad_input_is_one_line(tmp_path, make, options, message):
    dataset = make(tmp_path)
    with pytest.raises(UserError, match=message) as error:
        sources.load(Config(dataset=dataset, **options))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("bad_file", ["garbage", "other_size"])
def test_a_bad_file_found_while_reading_names_it(tmp_path, bad_file):
    """Only the first file of each class is decoded at start-up; a later bad one stops the pipeline
    with an error that names it."""
    split_folders(tmp_path)
    path = os.path.join(str(tmp_path), "test", "zebra", "img01008.png")
    if bad_file == "garbage":
        _garbage(path)
    else:
        tf.io.write_file(path, tf.io.encode_png(id_image(1008, (5, 5, 3))))
    source = sources.load(Config(dataset=f"images:{tmp_path}"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="img01008.png"):
        list(source.test_batches(4))


def test_the_checker_names_every_bad_file(tmp_path):
    """A truncated file fails inside TensorFlow's decoder, which does not name it; the checker does."""
    split_folders(tmp_path)
    truncated = os.path.join(str(tmp_path), "train", "moth", "img00008.png")  # not the first moth file
    with open(truncated, "rb") as f:
        data = f.read()
    _garbage(truncated, data[: len(data) // 2])
    tf.io.write_file(
        os.path.join(str(tmp_path), "test", "zebra", "img01008.png"), tf.io.encode_png(id_image(1008, (5, 5, 3)))
    )
    source = sources.load(Config(dataset=f"images:{tmp_path}"))  # only first files are decoded here
    with pytest.raises(tf.errors.InvalidArgumentError, match="Invalid PNG data"):
        list(source.train_dataset_fn(10, seed=1)(tf.distribute.InputContext(1, 0, 1)).take(3))
    out = io.StringIO()
    assert image_folders.main([str(tmp_path)], out=out) == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1] == "2 bad files"
    assert lines[0].startswith(f"{truncated}: corrupt image") and "img01008.png is 5x5 pixels but" in lines[1]
    out = io.StringIO()
    assert image_folders.main([str(tmp_path), "--image_size=8,8"], out=out) == 1  # sizes may then differ
    assert out.getvalue().splitlines()[-1] == "1 bad file"


@pytest.mark.fast
def test_split_by_hash_keeps_one_file_per_side():
    files = {"a": ["/d/a/1.png"], "b": ["/d/b/1.png", "/d/b/2.png"]}
    train, test = image_folders.split_by_hash(files, 0.01, "/d")
    assert train == {"a": ["/d/a/1.png"], "b": train["b"]} and len(train["b"]) == 1 and len(test["b"]) == 1
    assert "a" not in test
