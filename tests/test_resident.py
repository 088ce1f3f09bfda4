"""--input_mode=resident (engine/data/resident.py): the training arrays in every replica's memory,
batches gathered inside the compiled loop. It trains bit for bit like the tf.data pipeline (same
examples, same augmentation seeds, any replica count, accumulation), resumes exactly, and reads
a streamed source into memory exactly as the stream decodes it. Rollback: tests/test_rollback.py; two workers:
tests/test_multi_worker.py; with every other feature: tests/test_combinations.py."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import QUIET, TASKS_DATA, checkpoint_state, id_shards, small_config
from engine.controller.trainer import train
from engine.errors import UserError

# 10 batches an epoch, 23 steps: three epochs' permutations; a Task with per-example augmentation.
RUN = dict(
    synthetic_train_examples=640,
    global_batch=64,
    train_steps=23,
    steps_per_loop=5,
    task=f"{TASKS_DATA}:FlipTask",
    deterministic=True,
    eval_every=-1,
)


@pytest.mark.parametrize("replicas, accumulate", [(1, 1), (2, 2)])
def test_resident_trains_bit_for_bit_like_the_pipeline(tmp_path, replicas, accumulate):
    runs = {}
    for mode in ("distribute_dataset", "resident"):
        train(
            small_config(
                tmp_path / mode,
                **RUN,
                input_mode=mode,
                strategy="mirrored",
                cpu_replicas=replicas,
                grad_accum_steps=accumulate,
            ),
            **QUIET,
        )
        runs[mode] = checkpoint_state(tmp_path / mode)
    assert sorted(runs["resident"]) == sorted(runs["distribute_dataset"])
    for name, value in runs["resident"].items():
        np.testing.assert_array_equal(value, runs["distribute_dataset"][name], err_msg=name)


@pytest.mark.parametrize("replicas", [1, 2])
def test_resident_resumes_exactly(tmp_path, replicas):
    """One replica gathers one step ahead and gives the last batch back, several gather inside
    the step: either way the data position counts exactly the steps trained, so a resumed run
    draws the batches a straight run does."""
    config = small_config(
        tmp_path / "stopped", **RUN, input_mode="resident", strategy="mirrored", cpu_replicas=replicas
    )
    train(config.replace(train_steps=12), **QUIET)  # stops inside the second epoch
    _resumed_equals_straight(tmp_path, config, stopped_at=12)


def _resumed_equals_straight(tmp_path, config, stopped_at):
    """Resumes the run stopped at `stopped_at` in tmp_path/stopped to config.train_steps and checks
    it bit for bit against a straight run in tmp_path/straight."""
    assert train(config, **QUIET).start_step == stopped_at
    train(config.replace(model_dir=str(tmp_path / "straight")), **QUIET)
    stopped, straight = checkpoint_state(tmp_path / "stopped"), checkpoint_state(tmp_path / "straight")
    assert sorted(stopped) == sorted(straight)
    for name, value in stopped.items():
        np.testing.assert_array_equal(value, straight[name], err_msg=name)


def _image_shards(directory, png: bool):
    """TFRecords of 40 train and 12 test 16x16 grey images whose pixels take every uint8 value."""
    from engine.data import tfrecord

    pixels = (np.arange(52 * 256) % 256).astype(np.uint8).reshape(52, 16, 16)
    labels = np.arange(52) % 3
    tfrecord.write_shards(str(directory), "train", pixels[:40], labels[:40], 4, png=png)
    tfrecord.write_shards(str(directory), "test", pixels[40:], labels[40:], 2, png=png)
    return f"tfrecord:{directory}/train-*,{directory}/test-*", pixels, labels


@pytest.mark.parametrize("png", [True, False], ids=["png_records", "tensor_records"])
def test_a_streamed_source_is_read_into_memory_as_the_stream_decodes_it(tmp_path, png):
    from engine.config import Config
    from engine.data import sources

    dataset, pixels, labels = _image_shards(tmp_path / "data", png)
    streamed = sources.load(Config(dataset=dataset))
    loaded = sources.load(Config(dataset=dataset, input_mode="resident"))
    assert streamed.streamed and not loaded.streamed
    # Round-robin shards read one record of each in turn: the files' examples in the order written,
    # kept as the raw uint8 pixels (every value scaled back exactly from the decoder's x / 255).
    stored = pixels[..., None] if png else pixels  # a PNG holds a channel axis
    np.testing.assert_array_equal(loaded.x_train, stored[:40])
    np.testing.assert_array_equal(loaded.x_test, stored[40:])
    np.testing.assert_array_equal(loaded.y_train, labels[:40])
    assert loaded.spec == streamed.spec
    # What the step sees: the streamed decoder's examples, bit for bit.
    for (x, y), (xs, ys) in zip(loaded.test_batches(5), streamed.test_batches(5)):
        np.testing.assert_array_equal(x, xs)
        np.testing.assert_array_equal(y, ys)


def test_tfrecords_trained_from_memory_resume_exactly_and_refuse_the_streamed_order(tmp_path):
    dataset = id_shards(tmp_path / "data")
    config = small_config(
        tmp_path / "stopped",
        dataset=dataset,
        model="mlp",
        input_mode="resident",
        global_batch=32,
        train_steps=14,
        steps_per_loop=3,
        deterministic=True,
        eval_every=-1,
    )
    train(config.replace(train_steps=8), **QUIET)  # 6 batches an epoch: stops inside the second
    with pytest.raises(UserError, match=r"drawn from memory .* draws it streamed .* --input_mode"):
        train(config.replace(input_mode="auto"), **QUIET)
    _resumed_equals_straight(tmp_path, config, stopped_at=8)


@pytest.mark.fast
def test_a_streamed_source_over_the_memory_limit_is_refused_before_reading(tmp_path, monkeypatch):
    from engine.data import into_memory

    monkeypatch.setattr(into_memory, "MAX_IN_MEMORY_BYTES", 1000)
    with pytest.raises(
        UserError, match=r"--input_mode=resident: TFRecords .* 1,201 examples, .* over the .* drop --input_mode"
    ):
        train(
            small_config(tmp_path / "run", dataset=id_shards(tmp_path / "data"), model="mlp", input_mode="resident"),
            **QUIET,
        )


def test_auto_is_resident_unless_the_task_augments_each_example(tmp_path):
    from engine.config import Config, resolved_input_mode
    from engine.data import sources

    arrays = sources.load(Config(dataset="synthetic", synthetic_train_examples=64, synthetic_test_examples=32))
    streamed = sources.load(Config(dataset=id_shards(tmp_path / "data")))
    auto = Config(dataset="synthetic")
    assert auto.input_mode == "auto"
    assert resolved_input_mode(auto, arrays, augmented=False) == "resident"
    assert resolved_input_mode(auto, arrays, augmented=True) == "distribute_dataset"  # augments beside the step
    assert resolved_input_mode(auto, streamed, augmented=False) == "streamed"
    assert resolved_input_mode(auto.replace(input_mode="per_worker"), arrays, augmented=False) == "per_worker"
    # What a run prints: the mode it used.
    out = open(tmp_path / "out.txt", "w+")
    train(small_config(tmp_path / "run", train_steps=2, steps_per_loop=2, eval_every=-1), out=out)
    out.seek(0)
    assert "; --input_mode resident" in next(line for line in out if line.startswith("input "))
