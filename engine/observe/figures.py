"""Matplotlib figures as TensorBoard images: the one plotting path of the engine and of a Task.

    fig = new_figure(width=4, height=4)          # inches; 100 dots per inch
    ax = fig.subplots()
    ax.scatter(x, y)
    writer.write_figure(step, "samples", fig)    # engine/observe/summaries.py

Figures are drawn with the Agg canvas directly (no pyplot, no global backend, no window), on the
host between compiled loops, so drawing never touches training speed beyond the summary cadence.
"""

from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100


def new_figure(width: float, height: float) -> Figure:
    """A blank figure of width x height inches (DPI pixels each), laid out to fit its labels."""
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def figure_to_image(figure: Figure) -> np.ndarray:
    """The figure drawn as uint8 RGB of shape (1, height, width, 3), ready for tf.summary.image."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[np.newaxis, ..., :3].copy()
