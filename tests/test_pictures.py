"""The TensorBoard pictures, PR curves and Custom Scalars layout, checked on their own (matplotlib
for real, Agg canvas) and in a run's event files."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorflow as tf
from helpers import QUIET, small_config, tensorboard_run
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.pr_curve import plugin_data_pb2

from engine.controller.trainer import train
from engine.data.builtin import CLASS_NAMES
from engine.observe import figures, layout, pictures, pr_curves

FASHION = CLASS_NAMES["fashion_mnist"]


def _drawn_labels(figure, which: str) -> list:
    """The figure's x or y tick labels after drawing: (text, bounding box in pixels)."""
    figures.figure_to_image(figure)  # draws it on an Agg canvas
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    labels = ax.get_xticklabels() if which == "x" else ax.get_yticklabels()
    return [(label.get_text(), label.get_window_extent(renderer)) for label in labels if label.get_text()]


def _overlapping(boxes) -> list:
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def _counts(k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, 5000)
    predictions = np.where(rng.random(5000) < 0.7, labels, rng.integers(0, k, 5000))
    return pictures.confusion_counts(labels, predictions, k)


def test_confusion_matrix_names_the_classes_on_both_axes():
    figure = pictures.confusion_figure(_counts(10), FASHION)
    for axis in "xy":
        labels = _drawn_labels(figure, axis)
        assert [text for text, _ in labels] == list(FASHION)  # "T-shirt/top" ... "Ankle boot"
        assert not _overlapping(labels)
    image = figures.figure_to_image(figure)
    assert image.dtype == np.uint8 and image.ndim == 4 and image.shape[0] == 1 and image.shape[-1] == 3
    assert image.shape[1] > 300 and image.shape[2] > 300


def test_a_hundred_classes_keep_the_most_confused_and_no_label_overlaps():
    counts = _counts(100)
    counts[7, 42] += 400  # class 7 is mostly taken for 42: both must be kept
    figure = pictures.confusion_figure(counts, [f"class number {i}" for i in range(100)])
    assert "the 30 most-confused of 100 classes" in figure.axes[0].get_title()
    for axis in "xy":
        labels = _drawn_labels(figure, axis)
        assert len(labels) == 30 and not _overlapping(labels)
        assert {"class number 7", "class number 42"} <= {text for text, _ in labels}
    kept = pictures.most_confused(counts)
    errors = counts.sum(0) + counts.sum(1) - 2 * np.diag(counts)
    assert errors[kept].min() >= np.delete(errors, kept).max()


def test_per_class_accuracy_bars():
    counts = np.diag([10, 20, 30]).astype(np.int64)
    counts[1, 0] = 20  # class 1: 20 of 40 right
    figure = pictures.per_class_accuracy_figure(counts, ["ant", "bee", "cat"])
    assert [round(bar.get_width(), 3) for bar in figure.axes[0].patches] == [1.0, 0.5, 1.0]
    many = pictures.per_class_accuracy_figure(_counts(100), None)
    labels = _drawn_labels(many, "y")
    assert len(labels) == 30 and not _overlapping(labels) and "least accurate" in many.axes[0].get_title()


def test_image_grids_caption_each_tile_with_class_names():
    images = np.random.default_rng(0).random((5, 28, 28))
    figure = pictures.misclassified_figure(images, [0, 6, 9, 1, 2], [6, 0, 7, 3, 4], FASHION, 10)
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert texts[0] == "true T-shirt/top\nsaid Shirt" and len(texts) == 5
    assert figures.figure_to_image(figure).shape[-1] == 3


def test_pr_curve_counts_match_a_direct_count():
    rng = np.random.default_rng(1)
    positive, scores = rng.random(500) < 0.3, rng.random(500)
    data = pr_curves.curve(positive, scores, num_thresholds=11)
    for i, threshold in enumerate(np.linspace(0.0, 1.0, 11)):
        said = scores >= threshold
        tp, fp = (positive & said).sum(), (~positive & said).sum()
        assert data[:4, i].tolist() == [tp, fp, (~positive & ~said).sum(), (positive & ~said).sum()]
        assert data[4, i] == pytest.approx(tp / max(tp + fp, 1e-7)) and data[5, i] == pytest.approx(tp / positive.sum())


@pytest.mark.fast
def test_custom_scalars_layout_puts_train_and_eval_of_each_metric_on_one_chart():
    tag, serialized, _ = layout.layout_summary(["loss", "accuracy"])
    parsed = layout_pb2.Layout.FromString(serialized)
    charts = {chart.title: list(chart.multiline.tag) for category in parsed.category for chart in category.chart}
    assert charts["loss (train and eval)"] == ["^loss$"] and charts["accuracy (train and eval)"] == ["^accuracy$"]
    assert {"learning rate", "gradient norm (before clipping)", "examples per second"} <= set(charts)
    assert tag == "custom_scalars__config__"


def test_a_run_writes_pictures_pr_curves_and_the_layout(tmp_path):
    """100 classes: every picture is drawn, one PR curve per class at each evaluation."""
    train(small_config(tmp_path, num_classes=100, train_steps=4, steps_per_loop=2, eval_every=2), **QUIET)
    train_run, eval_run = tensorboard_run(tmp_path / "train"), tensorboard_run(tmp_path / "eval")
    tags = eval_run.Tags()["tensors"]
    curves = sorted(t for t in tags if t.startswith("pr_curves/"))
    assert curves == sorted(f"pr_curves/{i}" for i in range(100))
    for tag in curves:
        events = eval_run.Tensors(tag)
        assert [e.step for e in events] == [2, 4]
        assert tf.make_ndarray(events[-1].tensor_proto).shape == (6, pr_curves.NUM_THRESHOLDS)
    meta = eval_run.SummaryMetadata(curves[0])
    assert meta.plugin_data.plugin_name == "pr_curves"
    assert plugin_data_pb2.PrCurvePluginData.FromString(meta.plugin_data.content).num_thresholds == 51
    for tag in ("confusion_matrix", "per_class_accuracy", "misclassified"):
        assert [e.step for e in eval_run.Tensors(tag)] == [2, 4]
    width, height = (int(v) for v in tf.make_ndarray(eval_run.Tensors("confusion_matrix")[-1].tensor_proto)[:2])
    assert width > 600 and height > 600  # 30 named rows and columns, not a 248-pixel bitmap
    assert "custom_scalars__config__" in train_run.Tags()["tensors"]
    assert train_run.SummaryMetadata("custom_scalars__config__").plugin_data.plugin_name == "custom_scalars"
