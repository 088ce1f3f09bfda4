"""Per-class precision-recall curves for TensorBoard's PR Curves dashboard, computed with NumPy on
the host from the chief's predictions over the whole test set (one-vs-rest per class).

The tensor is the plugin's own layout: rows true positives, false positives, true negatives, false
negatives, precision, recall; one column per threshold i / (NUM_THRESHOLDS - 1), an example counted
positive at a threshold when its class probability is at least the threshold.
"""

from __future__ import annotations

import numpy as np
from tensorboard.plugins.pr_curve import metadata as pr_metadata

NUM_THRESHOLDS = 51
_MINIMUM_COUNT = 1e-7  # the plugin's own guard against 0 / 0


def curve(is_positive, scores, num_thresholds: int = NUM_THRESHOLDS) -> np.ndarray:
    """(6, num_thresholds) float32: TP, FP, TN, FN, precision, recall at each threshold. A NaN score
    (an example with non-finite inputs, which the evaluation's warning line names) counts as 0."""
    is_positive = np.asarray(is_positive, bool)
    scores = np.nan_to_num(np.asarray(scores, np.float64), nan=0.0)
    buckets = np.clip(np.floor(scores * (num_thresholds - 1)), 0, num_thresholds - 1).astype(np.int64)

    def at_or_above(mask):  # examples of `mask` whose score reaches each threshold
        return np.cumsum(np.bincount(buckets[mask], minlength=num_thresholds)[::-1])[::-1].astype(np.float64)

    tp, fp = at_or_above(is_positive), at_or_above(~is_positive)
    fn, tn = is_positive.sum() - tp, (~is_positive).sum() - fp
    precision = tp / np.maximum(tp + fp, _MINIMUM_COUNT)
    recall = tp / np.maximum(tp + fn, _MINIMUM_COUNT)
    return np.stack([tp, fp, tn, fn, precision, recall]).astype(np.float32)


def tag_of(name: str) -> str:
    """`pr_curves/<class name>` ("/" in a name would open a sub-group: replaced)."""
    return "pr_curves/" + str(name).replace("/", "_")


def summaries(labels, probabilities, names) -> list:
    """[(tag, (6, NUM_THRESHOLDS) tensor, serialized SummaryMetadata)], one per class."""
    labels, probabilities = np.asarray(labels), np.asarray(probabilities)
    out = []
    for i, name in enumerate(names):
        meta = pr_metadata.create_summary_metadata(
            display_name=str(name),
            description=f"class {i} ({name}) against the rest, over every test example",
            num_thresholds=NUM_THRESHOLDS,
        )
        out.append((tag_of(name), curve(labels == i, probabilities[:, i]), meta.SerializeToString()))
    return out
