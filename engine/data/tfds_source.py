"""`--dataset=tfds:NAME[:CONFIG]`: a TensorFlow Datasets builder already prepared under --data_dir, streamed.

Offline only: the engine never downloads nor prepares. It opens the prepared copy with
`tfds.builder(NAME, data_dir=--data_dir, config=CONFIG)` (a TFDS catalogue name, or any data set
prepared under DATA_DIR/NAME[/CONFIG]/VERSION: its class is not needed, TFDS reads the
dataset_info.json and features.json written next to the shards) and streams the split's TFRecord
shards as a `StreamSource` (engine/data/streams.py):
  units    the split's shard files (`info.splits[split].filepaths`), read with tf.data.TFRecordDataset
  decode   the builder's own parser (`info.features.deserialize_example`), keeping the pair
           `info.supervised_keys` = (features, label); uint8 images -> float32 in [0, 1]
  classes  the label's ClassLabel: `num_classes` and `names`
  splits   "train"; "test", else "validation"; counts from `info.splits[split].num_examples`
tensorflow-datasets is an optional extra (`pip install -e ".[tfds]"`), imported only here, when a
tfds: source is loaded.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from engine.data import streams
from engine.data.formats import normalise_features, normalise_labels
from engine.data.spec import DataSpec
from engine.errors import UserError

TEST_SPLITS = ("test", "validation")  # the first one the data set has is evaluated


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise UserError(
            f"--dataset=tfds:... needs TensorFlow Datasets, which is not installed ({err}); "
            'install the extra: pip install -e ".[tfds]"'
        ) from None
    return tfds


def prepare_hint(name: str, config: str, data_dir: str) -> str:
    """The command that prepares NAME[:CONFIG] into data_dir (run where there is internet)."""
    config_arg = f", config='{config}'" if config else ""
    return (
        f"run `python -c \"import tensorflow_datasets as tfds; tfds.builder('{name}'{config_arg}, "
        f"data_dir='{data_dir}').download_and_prepare()\"` on a machine with internet, then copy {data_dir} "
        "to this machine"
    )


def prepared(data_dir: str) -> list:
    """What is prepared under data_dir: NAME[/CONFIG]/VERSION of each dataset_info.json, sorted."""
    found = []
    for root, dirs, files in os.walk(data_dir):
        depth = os.path.relpath(root, data_dir).count(os.sep)
        if "dataset_info.json" in files:
            found.append(os.path.relpath(root, data_dir).replace(os.sep, "/"))
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "downloads"] if depth < 2 else []
    return sorted(found)


def _listed(found: list, limit: int = 12) -> str:
    if not found:
        return "no prepared data set"
    return ", ".join(found[:limit]) + (f" and {len(found) - limit} more" if len(found) > limit else "")


def _builder(tfds, name: str, config: str, data_dir: str, flag: str):
    """The prepared builder of NAME[:CONFIG] under data_dir, or a UserError saying how to get it."""
    full = f"{name}/{config}" if config else name
    try:
        builder = tfds.builder(name, data_dir=data_dir, config=config or None)
    except tfds.core.registered.DatasetNotFoundError:  # not in the catalogue, and no prepared files
        if os.path.isdir(os.path.join(data_dir, name)):
            held = prepared(data_dir)
            configs = sorted({p.split("/")[1] for p in held if p.startswith(name + "/") and p.count("/") == 2})
            if not config and configs:  # TFDS picks the default config only with NAME/.config (not copied)
                raise UserError(
                    f"{flag}: name the config of {name} prepared under {data_dir}: "
                    f"{', '.join(f'tfds:{name}:{c}' for c in configs)}"
                ) from None
            raise UserError(
                f"{flag}: {full} is not prepared under {data_dir} (which holds: "
                f"{_listed(held)}); {prepare_hint(name, config, data_dir)}"
            ) from None
        raise UserError(
            f"{flag}: unknown TFDS data set {name!r}: not in the TFDS catalogue and not prepared "
            f"under {data_dir} (which holds: {_listed(prepared(data_dir))})"
        ) from None
    except Exception as err:  # e.g. an unknown config of a catalogue builder, a corrupt dataset_info.json
        message = str(err).strip().splitlines()[0][:240] if str(err).strip() else type(err).__name__
        if config and "BuilderConfig" in message:
            configs = [c.name for c in getattr(tfds.builder_cls(name), "BUILDER_CONFIGS", [])]
            message = f"it has no config {config!r}; its configs: {', '.join(configs[:20]) or 'none'}"
        raise UserError(f"{flag}: TFDS cannot open {full} in {data_dir}: {message}") from None
    if not builder.is_prepared():
        raise UserError(f"{flag}: {full} is not prepared in {builder.data_dir}; {prepare_hint(name, config, data_dir)}")
    return builder


def _file_format(info) -> str:
    file_format = getattr(info, "file_format", None)
    return "tfrecord" if file_format is None else str(getattr(file_format, "value", file_format))


def _supervised_keys(info, where: str):
    keys = info.supervised_keys
    features = sorted(info.features.keys())
    if not keys:
        raise UserError(
            f"{where}: the builder has no supervised_keys (no (features, label) pair); its features are {features}"
        )
    if len(keys) != 2 or not all(isinstance(key, str) for key in keys):
        raise UserError(
            f"{where}: supervised_keys {keys!r} is not one (feature, label) pair of feature "
            f"names; its features are {features}"
        )
    return keys


def _check_numeric(feature, key: str, where: str) -> None:
    """The pair must be numbers (images, vectors, class ids): not text, not nested features."""
    try:
        dtype = tf.as_dtype(feature.dtype)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not (dtype.is_integer or dtype.is_floating or dtype.is_bool):
        raise UserError(
            f"{where}: supervised key {key!r} is {type(feature).__name__} "
            f"({getattr(dtype, 'name', 'nested')}); the engine trains on numbers (images, "
            "vectors, class ids)"
        )


def _units(info, split: str, where: str) -> np.ndarray:
    files = [os.fspath(path) for path in info.splits[split].filepaths]
    missing = [path for path in files if not tf.io.gfile.exists(path)]
    if not files or missing:
        raise UserError(
            f"{where}: the {split} split's shard {missing[0] if missing else '(none listed)'} is "
            f"missing ({len(missing)} of {len(files)} files); copy the prepared directory whole"
        )
    return np.array(files)


def load(argument: str, config) -> streams.StreamSource:
    """`argument` is NAME[:CONFIG]; `config.data_dir` the TFDS data directory (default: TFDS's own)."""
    flag = f"--dataset=tfds:{argument}"
    name, _, builder_config = argument.partition(":")
    if not name:
        raise UserError(f"{flag}: expected tfds:NAME[:CONFIG], e.g. tfds:mnist or tfds:cifar10")
    tfds = _import_tfds()
    data_dir = config.data_dir or tfds.core.constants.DATA_DIR
    builder = _builder(tfds, name, builder_config, data_dir, flag)
    info = builder.info
    where = f"TFDS {info.full_name} in {data_dir}"
    if _file_format(info) != "tfrecord":
        raise UserError(
            f"{where}: prepared as {_file_format(info)} files; the engine streams TFRecord: "
            f"prepare it with download_and_prepare(file_format='tfrecord')"
        )
    splits = sorted(info.splits.keys())
    test_split = next((s for s in TEST_SPLITS if s in info.splits), None)
    if "train" not in info.splits or test_split is None:
        raise UserError(f"{where}: needs a train split and a test (or validation) split; it has {splits}")
    if test_split != "test":
        where += f" (no test split: evaluates {test_split})"
    x_key, y_key = _supervised_keys(info, where)
    for key in (x_key, y_key):
        _check_numeric(info.features[key], key, where)

    # Decode only the pair: the other features are parsed but left as they are (SkipDecoding).
    features = info.features
    skip = {key: tfds.decode.SkipDecoding() for key in features.keys() if key not in (x_key, y_key)}

    def decode_raw(serialized):
        example = features.deserialize_example(serialized, decoders=skip)
        return example[x_key], example[y_key]

    def decode(serialized):
        x, y = decode_raw(serialized)
        return normalise_features(x, batched=False, on_cpu=True), normalise_labels(y)

    train_units, test_units = _units(info, "train", where), _units(info, test_split, where)
    x_spec, y_spec = tf.data.TFRecordDataset(train_units[:1]).map(decode).element_spec
    raw = tf.data.TFRecordDataset(train_units[:1]).map(decode_raw).element_spec[0]
    if x_spec.shape.num_elements() is None:
        raise UserError(
            f"{where}: feature {x_key!r} has shape {x_spec.shape}; every example must have the same "
            "shape (e.g. an Image feature with a fixed shape)"
        )
    label = features[y_key]
    num_classes = getattr(label, "num_classes", None) or config.num_classes or None
    if y_spec.dtype.is_integer and num_classes is None:
        raise UserError(f"{where}: label {y_key!r} is not a ClassLabel; give --num_classes")
    spec = DataSpec.of(
        (x_spec, y_spec),
        num_classes if y_spec.dtype.is_integer else None,
        getattr(label, "names", None),
        raw_features=tf.TensorSpec(raw.shape, raw.dtype),
    )
    return streams.StreamSource(
        name=f"tfds:{argument}",
        where=where,
        train_units=train_units,
        test_units=test_units,
        read=tf.data.TFRecordDataset,
        decode=decode,
        spec=spec,
        num_train=streams.check_not_empty(where, "train", info.splits["train"].num_examples),
        num_test=streams.check_not_empty(where, test_split, info.splits[test_split].num_examples),
        shuffle_buffer=config.shuffle_buffer,
        cache=config.cache,
    )
