"""TensorBoard images rendered with NumPy only: input grids, labelled tiles, confusion matrices.

Every function returns a uint8 RGB batch of shape (1, height, width, 3), ready for
tf.summary.image. Labels are drawn with a 3x5 pixel digit font (no matplotlib needed).
"""

from __future__ import annotations

import numpy as np

# 3x5 glyphs for 0-9, ">" (true > predicted) and " ", one row string per pixel row.
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"), "3": ("###", "..#", "###", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "###"),
    ">": ("#..", ".#.", "..#", ".#.", "#.."), " ": ("...", "...", "...", "...", "..."),
}
_RED, _GREEN, _WHITE = (255, 64, 64), (64, 220, 64), (255, 255, 255)


def _rgb(images) -> np.ndarray:
    """(n, h, w[, 1|3]) floats in [0, 1] (or uint8) -> (n, h, w, 3) uint8."""
    images = np.asarray(images)
    if images.dtype != np.uint8:
        images = (np.clip(images.astype(np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
    if images.ndim == 3:
        images = images[..., np.newaxis]
    return np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images[..., :3]


def draw_text(canvas: np.ndarray, text: str, row: int, col: int, color, scale: int = 1) -> None:
    """Draws `text` (digits, '>' and spaces) into canvas (h, w, 3) at (row, col), in place."""
    for i, char in enumerate(text):
        for r, line in enumerate(_GLYPHS.get(char, _GLYPHS[" "])):
            for c, pixel in enumerate(line):
                if pixel == "#":
                    top, left = row + r * scale, col + (i * 4 + c) * scale
                    canvas[top:top + scale, left:left + scale] = color


def grid(images, columns: int = 8, pad: int = 2, captions=None, caption_color=_RED) -> np.ndarray:
    """Tiles images into one (1, H, W, 3) image; captions (one string each) go under the tiles."""
    tiles = _rgb(images)
    n, h, w, _ = tiles.shape
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    caption_h = 7 if captions is not None else 0
    cell_h, cell_w = h + caption_h + pad, max(w, 4 * max((len(c) for c in captions or [""]), default=0)) + pad
    canvas = np.zeros((rows * cell_h + pad, columns * cell_w + pad, 3), np.uint8)
    for i in range(n):
        top, left = pad + (i // columns) * cell_h, pad + (i % columns) * cell_w
        canvas[top:top + h, left:left + w] = tiles[i]
        if captions is not None:
            draw_text(canvas, captions[i], top + h + 1, left, caption_color)
    return canvas[np.newaxis]


def confusion_matrix(labels, predictions, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over every example."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (np.asarray(labels, np.int64), np.asarray(predictions, np.int64)), 1)
    return counts


def confusion_image(counts: np.ndarray, cell: int = 24) -> np.ndarray:
    """A heat map of counts[true, predicted] (rows: true class, columns: predicted), each row
    normalised by its class size (white 0 -> dark blue 1), class numbers along the top and left."""
    k = counts.shape[0]
    rates = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    white, blue = np.array([255.0, 255.0, 255.0]), np.array([8.0, 48.0, 107.0])
    colors = (white + (blue - white) * rates[..., np.newaxis]).round().astype(np.uint8)
    margin = 4 * len(str(k - 1)) + 4
    canvas = np.full((margin + k * cell, margin + k * cell, 3), 255, np.uint8)
    canvas[margin:, margin:] = np.repeat(np.repeat(colors, cell, axis=0), cell, axis=1)
    for i in range(k):
        draw_text(canvas, str(i), 2, margin + i * cell + cell // 2 - 2, (0, 0, 0))
        draw_text(canvas, str(i), margin + i * cell + cell // 2 - 2, 1, (0, 0, 0))
    for t in range(k):  # counts in the cells, light on dark cells
        for p in range(k):
            color = _WHITE if rates[t, p] > 0.5 else (0, 0, 0)
            draw_text(canvas, str(counts[t, p])[:5], margin + t * cell + cell // 2 - 2, margin + p * cell + 1, color)
    return canvas[np.newaxis]


def misclassified_grid(images, labels, predictions, limit: int = 24, columns: int = 8):
    """(grid image or None, [(true, predicted), ...]) of the first `limit` wrong predictions, each
    captioned "true>predicted"."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    wrong = np.flatnonzero(labels != predictions)[:limit]
    pairs = [(int(labels[i]), int(predictions[i])) for i in wrong]
    if not pairs:
        return None, pairs
    return grid(np.asarray(images)[wrong], columns, captions=[f"{t}>{p}" for t, p in pairs]), pairs
