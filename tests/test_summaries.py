"""TensorBoard logs, read back with the tensorboard package's own reader."""

from __future__ import annotations

import os
import re

import pytest
import tensorflow as tf
from tensorboard.plugins.hparams import metadata as hparams_metadata

from helpers import QUIET, small_config, tensorboard_run
from engine import __version__
from engine.observe.summaries import create_writers
from engine.controller.trainer import train


def _scalars(logdir):
    accumulator = tensorboard_run(logdir)
    # tf.summary.* in TF 2 writes tensor events; EventAccumulator lists them under "tensors".
    return {tag: [e.step for e in accumulator.Tensors(tag)] for tag in accumulator.Tags()["tensors"]}


def _plugin(accumulator, tag):
    return accumulator.SummaryMetadata(tag).plugin_data.plugin_name


def _decode(event):
    return tf.make_ndarray(event.tensor_proto).item().decode()


def _text(accumulator, tag):
    return _decode(accumulator.Tensors(tag)[0])


def test_train_and_eval_scalars_at_global_steps(tmp_path):
    train(
        small_config(tmp_path, strategy="mirrored", cpu_replicas=2, train_steps=7, steps_per_loop=3, eval_every=4),
        **QUIET,
    )
    train_tags = _scalars(tmp_path / "train")
    for tag in ("loss", "accuracy", "grad_norm", "learning_rate", "steps_per_sec", "examples_per_sec", "loop_seconds"):
        assert train_tags[tag] == [3, 4, 7], tag  # loops end at 3, 4 (eval point), 7 (end)
    assert "config" in train_tags
    eval_tags = _scalars(tmp_path / "eval")
    assert eval_tags["loss"] == [4, 7] and eval_tags["accuracy"] == [4, 7]


def test_resumed_run_continues_the_step_axis(tmp_path):
    train(small_config(tmp_path, train_steps=3), **QUIET)
    train(small_config(tmp_path, train_steps=6), **QUIET)
    assert sorted(_scalars(tmp_path / "train")["loss"]) == [3, 6]


def test_scalars_written_compiled_read_back_as_written_eagerly(tmp_path):
    """write_scalars has an eager path (a name set's first write) and a compiled one (its later
    writes, or every write with every_loop): both give TensorBoard the same steps and values."""
    scalars = [{"loss": 2.5, "accuracy": 0.25}, {"loss": 1.5, "accuracy": 0.5}, {"loss": 0.5, "accuracy": 0.75}]
    for run, every_loop in (("eager_first", False), ("compiled", True)):
        writers = create_writers(str(tmp_path / run), is_chief=True)
        for step, values in enumerate(scalars, start=1):
            writers["train"].write_scalars(step, values, every_loop=every_loop)
        writers["train"].close()
    for run in ("eager_first", "compiled"):
        accumulator = tensorboard_run(tmp_path / run / "train")
        for name in ("loss", "accuracy"):
            events = accumulator.Tensors(name)
            assert [e.step for e in events] == [1, 2, 3], (run, name)
            assert [float(tf.make_ndarray(e.tensor_proto)) for e in events] == [v[name] for v in scalars], (run, name)


@pytest.mark.fast
def test_non_chief_writes_nothing(tmp_path):
    writers = create_writers(str(tmp_path), is_chief=False)
    writers["train"].write_scalars(1, {"loss": 1.0})
    writers["train"].close()
    assert os.listdir(tmp_path) == []


def test_grad_norm_is_the_global_norm_of_the_summed_gradients(tmp_path):
    """Per-replica gradients are partial sums (loss / GLOBAL batch): their norms are about half the
    global norm on 2 replicas. The logged norm is taken after the all-reduce, so 1 and 2 replicas
    agree, and it equals the norm of the gradient of the whole batch's loss."""
    one = train(small_config(tmp_path / "one", train_steps=1, steps_per_loop=1), **QUIET)
    two = train(
        small_config(tmp_path / "two", strategy="mirrored", cpu_replicas=2, train_steps=1, steps_per_loop=1), **QUIET
    )
    assert one.train_metrics["grad_norm"] > 0
    assert two.train_metrics["grad_norm"] == pytest.approx(one.train_metrics["grad_norm"], rel=1e-4)


def test_everything_a_researcher_watches(tmp_path):
    train(
        small_config(
            tmp_path,
            strategy="mirrored",
            cpu_replicas=2,
            train_steps=8,
            steps_per_loop=3,
            eval_every=4,
            histogram_every=4,
            trace_graph=True,
            profile_steps="2,6",
        ),
        **QUIET,
    )
    train_run, eval_run = tensorboard_run(tmp_path / "train"), tensorboard_run(tmp_path / "eval")
    train_tags, eval_tags = _scalars(tmp_path / "train"), _scalars(tmp_path / "eval")
    # Loops end at 2 (profile start), 4 (eval, histograms), 6 (profile end), 8.
    assert train_tags["grad_norm"] == [2, 4, 6, 8]
    # Text: config with the engine version, and the version on its own.
    assert _plugin(train_run, "config") == "text" and __version__ in _text(train_run, "config")
    assert _text(train_run, "engine_version") == f"ctl-engine {__version__}"
    # Images: sample inputs at 0; confusion matrix and misclassified at each evaluation.
    assert train_tags["sample_inputs"] == [0] and _plugin(train_run, "sample_inputs") == "images"
    for tag in ("confusion_matrix", "per_class_accuracy", "misclassified"):
        assert eval_tags[tag] == [4, 8] and _plugin(eval_run, tag) == "images"
    # The chief's predict pass agrees with the distributed evaluation over all 300 test examples
    # (a text of the same name lists each evaluation's mistakes).
    for text, accuracy in zip(eval_run.Tensors("misclassified_labels"), eval_run.Tensors("accuracy")):
        wrong = int(re.search(r"(\d+) of 300 test images wrong", _decode(text)).group(1))
        assert wrong == round(300 * (1 - float(tf.make_ndarray(accuracy.tensor_proto))))
    # Histograms of every weight and gradient at 4 and 8.
    names = [v for v in train_tags if v.startswith(("weights/", "gradients/"))]
    assert len(names) == 12 and all(train_tags[n] == [4, 8] for n in names)
    assert _plugin(train_run, names[0]) == "histograms"
    # Graph of the first loop; profiler trace for the Profile tab.
    assert train_tags["train_loop"] == [2] and _plugin(train_run, "train_loop") == "graph_run_metadata_graph"
    profile_dir = tmp_path / "train" / "plugins" / "profile"
    assert any(name.endswith(".xplane.pb") for _, _, files in os.walk(profile_dir) for name in files)
    # HParams: one session in the eval run, holding the flags, referencing the eval metrics.
    assert _plugin(eval_run, hparams_metadata.SESSION_START_INFO_TAG) == hparams_metadata.PLUGIN_NAME
    start = hparams_metadata.parse_session_start_info_plugin_data(
        eval_run.SummaryMetadata(hparams_metadata.SESSION_START_INFO_TAG).plugin_data.content
    )
    assert start.hparams["global_batch"].number_value == 64 and start.hparams["summaries"].string_value == "full"
    experiment = hparams_metadata.parse_experiment_plugin_data(
        eval_run.SummaryMetadata(hparams_metadata.EXPERIMENT_TAG).plugin_data.content
    )
    assert sorted(m.name.tag for m in experiment.metric_infos) == ["accuracy", "loss"]


def test_basic_summaries_write_no_extras(tmp_path):
    train(small_config(tmp_path, summaries="basic"), **QUIET)
    train_tags, eval_tags = _scalars(tmp_path / "train"), _scalars(tmp_path / "eval")
    assert sorted(train_tags) == sorted(
        [
            "config",
            "engine_version",
            "loss",
            "accuracy",
            "learning_rate",
            "steps_per_sec",
            "examples_per_sec",
            "loop_seconds",
        ]
    )
    assert sorted(eval_tags) == ["accuracy", "loss"]
    assert not os.path.exists(tmp_path / "train" / "plugins")
