"""--dataset=tfds:NAME[:CONFIG]: a tiny TensorFlow Datasets builder, prepared here from Python (no
network), read back by the engine from its directory alone: spec, classes, counts, the validation
fallback, eval over every example once, training (in process and through run.py), the bad inputs.

The builder class is not registered (skip_registration), so the engine opens the data the way it
would on a machine that only received the prepared directory: from its dataset_info.json.
tensorflow-datasets is in the test extra, so these tests run in CI (offline: the data is generated
here, never downloaded)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, REPO, run_cli, small_config, stream_eval_totals
from engine.config import Config
from engine.controller.trainer import train
from engine.data import sources
from engine.errors import UserError
from tasks_data import IdCountingTask

NAMES = ["a", "b", "c"]
SPLITS = {"train": (40, 0), "test": (11, 100), "validation": (13, 200)}  # split: (examples, first id)
_BUILDERS = {}


def builder_classes():
    """(TinyShapes: not registered, TinyRegistered: in the TFDS registry). Example i of a split has
    id = first id + i, every pixel equal to the id (so x * 255 gives it back) and label id % 3.
    Configs: colour (8x8x3, train, test and validation), grey (8x8x1, train and validation), unsupervised (no
    supervised_keys), text (supervised_keys ("caption", "label"): a Text feature)."""
    if not _BUILDERS:
        import tensorflow_datasets as tfds  # in the test extra: these tests always run

        class TinyShapes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
            VERSION = tfds.core.Version("1.0.0")
            BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=n) for n in ("colour", "grey", "unsupervised", "text")]

            def _channels(self):
                return 1 if self.builder_config.name == "grey" else 3

            def _info(self):
                return tfds.core.DatasetInfo(
                    builder=self,
                    features=tfds.features.FeaturesDict(
                        {
                            "image": tfds.features.Image(shape=(8, 8, self._channels())),
                            "label": tfds.features.ClassLabel(names=NAMES),
                            "id": tf.int64,
                            "caption": tfds.features.Text(),
                        }
                    ),
                    supervised_keys={"unsupervised": None, "text": ("caption", "label")}.get(
                        self.builder_config.name, ("image", "label")
                    ),
                )

            def _split_generators(self, dl_manager):
                splits = ("train", "validation") if self.builder_config.name == "grey" else tuple(SPLITS)
                return {split: self._generate_examples(*SPLITS[split]) for split in splits}

            def _generate_examples(self, count, first):
                for i in range(first, first + count):
                    image = np.full((8, 8, self._channels()), i, np.uint8)
                    yield i, {"image": image, "label": i % 3, "id": i, "caption": f"example {i}"}

        class TinyRegistered(TinyShapes):  # registered as "tiny_registered", like a catalogue builder
            pass

        _BUILDERS.update(unregistered=TinyShapes, registered=TinyRegistered)
    return _BUILDERS["unregistered"], _BUILDERS["registered"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data directory: tiny_shapes/{colour,grey,text,unsupervised}/1.0.0, tiny_registered/colour/1.0.0."""
    tiny, registered = builder_classes()
    directory = str(tmp_path_factory.mktemp("tfds"))
    for config in ("colour", "grey", "unsupervised", "text"):
        tiny(data_dir=directory, config=config).download_and_prepare()
    registered(data_dir=directory, config="colour").download_and_prepare()
    return directory


def ids_of(x):
    """The example ids images carry (every pixel = id / 255)."""
    return np.rint(np.asarray(x)[:, 0, 0, 0] * 255).astype(np.int64)


@pytest.mark.parametrize("name", ["tiny_shapes", "tiny_registered"])
def test_tfds_spec_classes_counts_and_pairs(data_dir, name):
    source = sources.load(Config(dataset=f"tfds:{name}:colour", data_dir=data_dir))
    assert source.streamed and source.where == f"TFDS {name}/colour/1.0.0 in {data_dir}"
    spec = source.spec
    assert spec.input_shape == (8, 8, 3) and spec.features.dtype == tf.float32 and spec.is_image
    assert spec.labels.dtype == tf.int32 and spec.labels.shape == ()
    assert spec.num_classes == 3 and spec.class_names == tuple(NAMES)
    assert (source.num_train, source.num_test) == (40, 11)  # test, not validation (13)
    x, y = source.preview(40)
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0  # uint8 -> [0, 1]
    assert sorted(ids_of(x)) == list(range(40))  # each image decoded whole, with its own label
    np.testing.assert_array_equal(y, ids_of(x) % 3)
    test_ids = np.concatenate([ids_of(x) for x, _ in source.test_batches(4)])
    assert sorted(test_ids) == list(range(100, 111))


@pytest.mark.fast
def test_tfds_config_without_test_split_evaluates_validation(data_dir):
    source = sources.load(Config(dataset="tfds:tiny_shapes:grey", data_dir=data_dir))
    assert "tiny_shapes/grey/1.0.0" in source.where and "evaluates validation" in source.where
    assert source.spec.input_shape == (8, 8, 1) and source.spec.is_image
    assert (source.num_train, source.num_test) == (40, 13)
    test = [(ids_of(x), y) for x, y in source.test_batches(5)]
    ids, labels = np.concatenate([i for i, _ in test]), np.concatenate([y for _, y in test])
    assert sorted(ids) == list(range(200, 213))
    np.testing.assert_array_equal(labels, ids % 3)


class PixelIdTask(IdCountingTask):
    """Sums the examples' ids, read back from the pixels."""

    @staticmethod
    def example_ids(x):
        return tf.round(x[:, 0, 0, 0] * 255.0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_tfds_eval_covers_every_example_once(data_dir, replicas):
    source = sources.load(Config(dataset="tfds:tiny_shapes:colour", data_dir=data_dir))
    assert stream_eval_totals(source, replicas, 4, PixelIdTask) == (11, sum(range(100, 111)))


def test_tfds_trains_end_to_end(data_dir, tmp_path):
    config = small_config(
        tmp_path / "run",
        dataset="tfds:tiny_shapes",
        data_dir=data_dir,
        global_batch=8,
        train_steps=6,
        steps_per_loop=3,
        strategy="mirrored",
        cpu_replicas=2,
        shuffle_buffer=16,
    )
    result = train(config, **QUIET)
    assert result.final_step == 6 and np.isfinite(result.eval_metrics["loss"])
    assert 0.0 <= result.eval_metrics["accuracy"] <= 1.0


def test_tfds_cli_run_needs_only_the_prepared_directory(data_dir, tmp_path):
    """A fresh process that never saw the builder class trains from the copied directory."""
    copy = str(tmp_path / "copied")
    shutil.copytree(os.path.join(data_dir, "tiny_shapes"), os.path.join(copy, "tiny_shapes"))
    proc = run_cli(
        "--dataset=tfds:tiny_shapes:grey",
        f"--data_dir={copy}",
        "--global_batch=8",
        "--train_steps=4",
        "--steps_per_loop=2",
        "--model=mlp",
        "--seed=1",
        "--noexport",
        f"--model_dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tiny_shapes/grey/1.0.0" in proc.stdout + proc.stderr


def _array_record_dir(tmp_path):
    tiny, _ = builder_classes()
    tiny(data_dir=str(tmp_path), config="colour", file_format="array_record").download_and_prepare()
    return str(tmp_path)


def _config_dir_copy(data_dir, tmp_path):
    """DATA_DIR/tiny_shapes/colour copied alone (without tiny_shapes/.config, which names the default)."""
    shutil.copytree(os.path.join(data_dir, "tiny_shapes", "colour"), tmp_path / "tiny_shapes" / "colour")
    return str(tmp_path)


def _missing_shard_dir(data_dir, tmp_path):
    _config_dir_copy(data_dir, tmp_path)
    os.remove(tmp_path / "tiny_shapes" / "colour" / "1.0.0" / "tiny_shapes-test.tfrecord-00000-of-00001")
    return str(tmp_path)


@pytest.mark.parametrize(
    "dataset, directory, message",
    [
        (
            "tfds:mnist",
            "empty",
            r"mnist is not prepared in .*mnist/3\.0\.1; run `python -c \"import "
            r"tensorflow_datasets as tfds; tfds\.builder\('mnist', data_dir='.*'\)\.download_and_prepare\(\)\"` on a "
            r"machine with internet, then copy",
        ),
        (
            "tfds:no_such_data_set",
            "data",
            r"unknown TFDS data set 'no_such_data_set': not in the TFDS catalogue "
            r"and not prepared under .* \(which holds: tiny_registered/colour/1\.0\.0, tiny_shapes/colour/1\.0\.0, "
            r"tiny_shapes/grey/1\.0\.0, tiny_shapes/text/1\.0\.0, tiny_shapes/unsupervised/1\.0\.0\)",
        ),
        ("tfds:tiny_shapes:nope", "data", r"tiny_shapes/nope is not prepared under .*config='nope'"),
        ("tfds:mnist:nope", "empty", r"mnist/nope .*it has no config 'nope'"),
        (
            "tfds:tiny_shapes:unsupervised",
            "data",
            r"no supervised_keys .*features are \['caption', 'id', 'image', 'label'\]",
        ),
        ("tfds:tiny_shapes:text", "data", r"supervised key 'caption' is Text \(string\); the engine trains on numbers"),
        ("tfds:tiny_shapes", "array_record", r"prepared as array_record files; the engine streams TFRecord"),
        (
            "tfds:tiny_shapes",
            "config_dir_only",
            r"name the config of tiny_shapes prepared under .*: "
            r"tfds:tiny_shapes:colour$",
        ),
        (
            "tfds:tiny_shapes:colour",
            "missing_shard",
            r"the test split's shard .*tiny_shapes-test\.tfrecord-00000-of-00001 "
            r"is missing",
        ),
        ("tfds:tiny_shapes:colour --num_classes=5", "data", r"--num_classes=5 but TFDS .* has 3 classes"),
    ],
    ids=[
        "not_prepared",
        "unknown_name",
        "unknown_config",
        "catalogue_config",
        "no_supervised_keys",
        "text_feature",
        "array_record",
        "config_dir_only",
        "missing_shard",
        "num_classes",
    ],
)
def test_tfds_bad_inputs_are_one_line_errors(data_dir, tmp_path, dataset, directory, message):
    dataset, _, num_classes = dataset.partition(" --num_classes=")
    directories = {
        "data": lambda: data_dir,
        "empty": lambda: str(tmp_path),
        "array_record": lambda: _array_record_dir(tmp_path),
        "config_dir_only": lambda: _config_dir_copy(data_dir, tmp_path),
        "missing_shard": lambda: _missing_shard_dir(data_dir, tmp_path),
    }
    config = Config(dataset=dataset, data_dir=directories[directory](), num_classes=int(num_classes or 0))
    with pytest.raises(UserError, match=message) as error:
        sources.load(config)
    assert "\n" not in str(error.value)


def test_tfds_not_installed_is_one_line_error_and_engine_imports_without_it(monkeypatch):
    # Python's own "not installed": a None entry makes `import tensorflow_datasets` raise ImportError.
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(
        UserError, match=r'TensorFlow Datasets, which is not installed .*pip install -e "\.\[tfds\]"'
    ) as error:
        sources.load(Config(dataset="tfds:mnist"))
    assert "\n" not in str(error.value)
    # The engine imports tensorflow_datasets only for a tfds: source.
    check = (
        "import sys, run, engine.controller.trainer, engine.data.sources, engine.data.tfds_source; "
        "sys.exit('tensorflow_datasets' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
