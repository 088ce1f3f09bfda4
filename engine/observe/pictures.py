"""The engine's own TensorBoard pictures of a classifier, drawn with matplotlib (engine/observe/figures.py):
the confusion matrix, per-class accuracy and captioned image grids. Each function returns a
matplotlib Figure; `figures.figure_to_image` turns it into the image summary.

Beyond MAX_CLASSES_SHOWN classes a picture keeps the classes that matter (the most confused, the
least accurate) and says so in its title, so no label ever overlaps another.
"""

from __future__ import annotations

import numpy as np

from engine.observe.figures import new_figure

MAX_CLASSES_SHOWN = 30  # classes on a picture's axis; beyond it the most-confused are kept
COUNTS_IN_CELLS_UP_TO = 15  # classes up to which the confusion matrix writes counts in its cells
GRID_COLUMNS = 8
RIGHT, WRONG = "#1a7f37", "#cf222e"  # caption colours (a correct label, a wrong prediction)


def names_of(num_classes: int, class_names=None) -> list:
    """Class i's name: the data's own when it has them, else the number."""
    return [str(name) for name in class_names] if class_names else [str(i) for i in range(num_classes)]


def confusion_counts(labels, predictions, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over every example."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (np.asarray(labels, np.int64), np.asarray(predictions, np.int64)), 1)
    return counts


def most_confused(counts: np.ndarray, limit: int = MAX_CLASSES_SHOWN) -> np.ndarray:
    """The indices (ascending) of the `limit` classes with the most errors in or out (every class
    when there are no more than `limit`)."""
    k = counts.shape[0]
    if k <= limit:
        return np.arange(k)
    errors = counts.sum(axis=0) + counts.sum(axis=1) - 2 * np.diag(counts)
    return np.sort(np.argsort(-errors, kind="stable")[:limit])


def recall(counts: np.ndarray) -> np.ndarray:
    """Per-class accuracy: the fraction of each true class predicted as itself."""
    return np.diag(counts) / np.maximum(counts.sum(axis=1), 1)


def confusion_figure(counts: np.ndarray, class_names=None):
    """Rows: true class, columns: predicted, colour normalised per true class (0 white to 1 dark
    blue), counts in the cells where they fit, class names on both axes."""
    k = counts.shape[0]
    names = names_of(k, class_names)
    shown = most_confused(counts)
    rates = (counts / np.maximum(counts.sum(axis=1, keepdims=True), 1))[np.ix_(shown, shown)]
    m = len(shown)
    longest = max(len(names[i]) for i in shown)
    side = 0.3 * m + 0.07 * longest + 1.5
    figure = new_figure(side + 1.0, side)
    ax = figure.subplots()
    image = ax.imshow(rates, cmap="Blues", vmin=0.0, vmax=1.0)
    figure.colorbar(image, ax=ax, shrink=0.8, label="fraction of the true class")
    font = 9 if m <= COUNTS_IN_CELLS_UP_TO else 7
    ax.set_xticks(range(m), [names[i] for i in shown], rotation=90, fontsize=font)
    ax.set_yticks(range(m), [names[i] for i in shown], fontsize=font)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    total = int(counts.sum())
    ax.set_title(
        f"{total} test examples, {total - int(np.trace(counts))} wrong"
        + (f"\nthe {m} most-confused of {k} classes" if m < k else ""),
        fontsize=10,
    )
    if m <= COUNTS_IN_CELLS_UP_TO:
        sub = counts[np.ix_(shown, shown)]
        for t in range(m):
            for p in range(m):
                if sub[t, p]:
                    ax.text(
                        p,
                        t,
                        str(sub[t, p]),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if rates[t, p] > 0.5 else "black",
                    )
    return figure


def per_class_accuracy_figure(counts: np.ndarray, class_names=None):
    """A horizontal bar per class: its accuracy (recall) on the test set, in class order (beyond
    MAX_CLASSES_SHOWN classes: the least accurate, worst first)."""
    k = counts.shape[0]
    names = names_of(k, class_names)
    accuracy = recall(counts)
    shown = np.arange(k) if k <= MAX_CLASSES_SHOWN else np.argsort(accuracy, kind="stable")[:MAX_CLASSES_SHOWN]
    figure = new_figure(6.0, 0.28 * len(shown) + 1.2)
    ax = figure.subplots()
    rows = np.arange(len(shown))
    ax.barh(rows, accuracy[shown], color="#4c78a8")
    ax.set_yticks(rows, [names[i] for i in shown], fontsize=8)
    ax.invert_yaxis()  # the first class (or the worst) at the top
    ax.set_xlim(0.0, 1.08)
    ax.set_xlabel("accuracy on the test examples of the class")
    for row, value in zip(rows, accuracy[shown]):
        ax.text(value + 0.01, row, f"{value:.3f}", va="center", fontsize=7)
    ax.set_title(
        f"per-class accuracy (mean {accuracy.mean():.3f})"
        + (f", the {len(shown)} least accurate of {k} classes" if len(shown) < k else ""),
        fontsize=10,
    )
    return figure


def _tiles(images) -> np.ndarray:
    """(n, h, w[, 1|3]) floats in [0, 1] or uint8 -> (n, h, w, 3) floats in [0, 1]."""
    images = np.asarray(images)
    images = images / 255.0 if images.dtype == np.uint8 else np.clip(images.astype(np.float32), 0.0, 1.0)
    if images.ndim == 3:
        images = images[..., np.newaxis]
    return np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images[..., :3]


def image_grid_figure(images, captions, colors=None, columns: int = GRID_COLUMNS):
    """The images tiled GRID_COLUMNS to a row, each with its caption (one or two lines) beneath in its
    colour. One imshow of the whole mosaic (fast to draw), captions as text."""
    tiles = _tiles(images)
    n, h, w, _ = tiles.shape
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    pad = max(2, h // 14)
    caption_rows = max(caption.count("\n") + 1 for caption in captions)
    cell_h, cell_w = h + pad + int(h * 0.24 * caption_rows), w + pad
    mosaic = np.ones((rows * cell_h, columns * cell_w, 3), np.float32)
    for i in range(n):
        top, left = (i // columns) * cell_h, (i % columns) * cell_w
        mosaic[top : top + h, left : left + w] = tiles[i]
    figure = new_figure(1.25 * columns, 1.25 * rows * cell_h / cell_w)
    ax = figure.subplots()
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_axis_off()
    for i, caption in enumerate(captions):
        top, left = (i // columns) * cell_h, (i % columns) * cell_w
        ax.text(
            left + w / 2,
            top + h + pad / 2,
            caption,
            ha="center",
            va="top",
            fontsize=7,
            color=(colors[i] if colors else "black"),
        )
    return figure


def misclassified_figure(images, labels, predictions, class_names, num_classes: int):
    """The wrong predictions' images, each captioned with the true and the predicted class."""
    names = names_of(num_classes, class_names)
    captions = [f"true {names[t]}\nsaid {names[p]}" for t, p in zip(labels, predictions)]
    return image_grid_figure(images, captions, [WRONG] * len(captions))
