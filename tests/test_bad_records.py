"""Bad records end in one line naming the file, the record's offset and the cause, before or during
training (engine/data/bad_records.py, engine/data/tfrecord.py's scan, engine/controller/job.py); a
mid-run failure keeps the checkpoints and claims nothing after the last one; non-finite eval inputs
or metrics print one warning line (engine/controller/evaluation.py). docs/failures.md#bad-records."""

from __future__ import annotations

import glob
import io
import os
import threading

import numpy as np
import pytest
import tensorflow as tf

from engine.config import Config
from engine.controller.trainer import train
from engine.data import bad_records, sources, tfrecord
from engine.errors import UserError
from helpers import QUIET, run_cli, small_config


def _shards(directory, count=320, shards=2):
    x = np.random.RandomState(0).rand(count, 4).astype(np.float32)
    return tfrecord.write_shards(str(directory), "train", x, (np.arange(count) % 2).astype(np.int64), shards)


def _records(path) -> list:
    return [record.numpy() for record in tf.data.TFRecordDataset(path)]


def _rewrite(path, records) -> None:
    with tf.io.TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)


def _flip_byte(path, at):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path, by):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-by])


def _not_an_example(path):
    records = _records(path)
    records[5] = b"\xff\xfe not a serialized tf.train.Example"
    _rewrite(path, records)


def _missing_feature(path):
    records = _records(path)
    example = tf.train.Example.FromString(records[7])
    del example.features.feature["x"]
    records[7] = example.SerializeToString()
    _rewrite(path, records)


def _offset(path, index) -> int:
    """The byte offset of record `index` of `path` (length 8 + CRC 4, data, CRC 4 per record)."""
    return sum(len(record) + 16 for record in _records(path)[:index])


@pytest.mark.fast
@pytest.mark.parametrize(
    "damage, index, cause",
    [
        (lambda p: _flip_byte(p, _offset(p, 7) + 20), 7, "corrupted record at {data}"),  # a bad CRC
        (lambda p: _truncate(p, 30), 159, "truncated record at {offset} (Read less bytes than requested)"),
        (_not_an_example, 5, "not a tf.train.Example"),
        (_missing_feature, 7, "Feature: x (data type: string) is required but could not be found"),
    ],
    ids=["bad_crc", "truncated", "not_an_example", "missing_feature"],
)
def test_a_bad_record_at_start_up_names_its_file_index_offset_and_cause(tmp_path, damage, index, cause):
    bad = _shards(tmp_path)[1]
    offset = _offset(bad, index)
    damage(bad)
    with pytest.raises(UserError) as raised:
        sources.load(Config(dataset=f"tfrecord:{tmp_path}/train-*"))
    assert (
        raised.value.message
        == f"{bad}: record {index} (byte {offset}): {cause.format(offset=offset, data=offset + 12)}"
    )


def _parse_example(serialized):  # a Task's own record layout: "x" a serialized float32 (4,) tensor
    parsed = tf.io.parse_single_example(
        serialized, {"x": tf.io.FixedLenFeature((), tf.string), "label": tf.io.FixedLenFeature((), tf.int64)}
    )
    return tf.ensure_shape(tf.io.parse_tensor(parsed["x"], tf.float32), (4,)), parsed["label"]


def test_a_record_only_decoding_rejects_is_found_again_after_the_failure(tmp_path):
    good = _shards(tmp_path / "a")[0]
    other = tfrecord.write_shards(str(tmp_path / "b"), "train", np.zeros((20, 5), np.float32), np.zeros(20, int), 1)[0]
    source = sources.load(Config(dataset=f"tfrecord:{good},{other}"))  # the start-up scan parses, not decodes
    assert bad_records.locate(source, source.loaded_at).startswith(
        f"{other}: record 0 (byte 0): {good}: a record's 'x' is not a float32 tensor of shape [4]"
    )
    _missing_feature(good)
    source = sources.load(Config(dataset=f"tfrecord:{tmp_path}/a/train-*"), parse_example=_parse_example)
    assert bad_records.locate(source, 0) == (
        f"{good}: record 7 (byte {_offset(good, 7)}): Feature: x (data type: string) is required but could not be found"
    )
    assert bad_records.locate(sources.load(Config(dataset=f"tfrecord:{tmp_path}/a/train-00001*")), 0) is None


def test_a_record_that_is_not_an_example_ends_run_py_in_one_line(tmp_path):
    bad = _shards(tmp_path)[1]
    _not_an_example(bad)
    done = run_cli(f"--dataset=tfrecord:{tmp_path}/train-*", "--model=mlp", f"--model_dir={tmp_path}/run")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"error: {bad}: record 5 (byte {_offset(bad, 5)}): not a tf.train.Example"
    assert "Traceback" not in done.stderr and "UnicodeDecodeError" not in done.stderr


def _train_until_damaged(tmp_path, dataset, damage, **flags):
    """Trains in this process; once the first checkpoint exists, a thread damages the data. Returns
    the run's one-line error and the checkpoints left."""
    model_dir = str(tmp_path / "run")

    def when_saved():
        for _ in range(12_000):  # 2 minutes at most
            if glob.glob(f"{model_dir}/checkpoints/ckpt-*.index"):
                damage()
                return
            threading.Event().wait(0.01)

    threading.Thread(target=when_saved, daemon=True).start()
    config = small_config(
        model_dir, dataset=dataset, model="mlp", train_steps=4000, steps_per_loop=5, checkpoint_every=10, **flags
    )
    with pytest.raises(UserError) as raised:
        train(config, **QUIET)
    return raised.value.message, tf.train.get_checkpoint_state(f"{model_dir}/checkpoints")


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_shard_overwritten_while_training_names_file_and_cause_and_keeps_the_checkpoints(tmp_path, replicas):
    paths = _shards(tmp_path / "rec", count=640, shards=4)
    offset = _offset(paths[2], 14)
    message, state = _train_until_damaged(
        tmp_path,
        f"tfrecord:{tmp_path}/rec/train-*",
        lambda: _flip_byte(paths[2], offset + 20),
        global_batch=32,
        shuffle_buffer=50,
        eval_every=-1,
        **(dict(strategy="mirrored", cpu_replicas=2) if replicas == 2 else {}),
    )
    latest = state.model_checkpoint_path
    assert message.startswith(f"--dataset=tfrecord:{tmp_path}/rec/train-*: the input pipeline failed after step ")
    assert f": {paths[2]}: record 14 (byte {offset}): corrupted record at {offset + 12}; " in message
    assert message.endswith(
        f"nothing was saved after step {latest.rpartition('-')[2]}: {latest} is intact; "
        "fix or replace the file, then rerun the same command to resume"
    )
    assert latest in state.all_model_checkpoint_paths  # the one named is listed and whole
    tf.train.load_checkpoint(latest).get_variable_to_shape_map()


_PNG = tf.io.encode_png(np.zeros((4, 4, 1), np.uint8)).numpy()
_CORRUPT_PNG = _PNG[:8] + b"garbage" * 20  # a PNG signature, then garbage: found only when decoded


def _image_folders(root):
    for split, count in (("train", 64), ("test", 8)):
        for label in ("a", "b"):
            os.makedirs(root / split / label)
            for i in range(count // 2):
                (root / split / label / f"{i:03d}.png").write_bytes(_PNG)
    return root / "train" / "b" / "017.png"


def test_a_corrupt_image_read_into_memory_is_named(tmp_path):
    bad = _image_folders(tmp_path / "img")
    bad.write_bytes(_CORRUPT_PNG)
    with pytest.raises(UserError, match=f"^--input_mode=resident: reading .* into memory failed: {bad}: .*PNG"):
        sources.load(Config(dataset=f"images:{tmp_path / 'img'}", input_mode="resident"))


def test_a_corrupt_image_met_while_training_is_named(tmp_path):
    bad = _image_folders(tmp_path / "img")
    message, state = _train_until_damaged(
        tmp_path,
        f"images:{tmp_path / 'img'}",
        lambda: bad.write_bytes(_CORRUPT_PNG),
        global_batch=16,
        shuffle_buffer=8,
        eval_every=-1,
    )
    assert "the input pipeline failed after step " in message and f": {bad}: " in message
    assert "PNG" in message and "is intact" in message and state.model_checkpoint_path in message


def test_non_finite_eval_inputs_print_one_warning_and_training_goes_on(tmp_path):
    x_test = np.zeros((40, 6), np.float32)
    x_test[3, 2] = np.nan
    np.savez(
        tmp_path / "d.npz",
        x_train=np.random.RandomState(0).rand(256, 6).astype(np.float32),
        y_train=np.arange(256) % 2,
        x_test=x_test,
        y_test=np.arange(40) % 2,
    )
    out = io.StringIO()
    result = train(small_config(tmp_path / "run", dataset=f"npz:{tmp_path}/d.npz", model="mlp", eval_every=3), out=out)
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning")]
    assert result.final_step == 6
    assert [w.split(":")[0] for w in warnings] == ["warning      eval step 3", "warning      eval step 6"]
    assert "1 test examples hold NaN or Inf inputs; non-finite metric loss nan" in warnings[0]
