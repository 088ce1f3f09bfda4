"""A classifier scored by macro-F1 and one-vs-rest AUC over the WHOLE eval set, through
`self.collect` and `Task.eval_summary`.

    python run.py --task=examples/auc_f1.py:AucF1Task --model=cnn --dataset=fashion_mnist \
        --strategy=mirrored --cpu_replicas=2 --best_metric=+macro_auc

Shows: metrics that are not a sum over examples (AUC ranks every example's score against every
other's; F1 needs each class's whole-set counts), so they cannot be returned as (total, count).
eval_step hands each example's class probabilities and label to the host with `self.collect`;
after each evaluation `eval_summary` gets them for every eval example once, in the eval set's
order, on 1 or N replicas alike, and returns scalars the engine prints, writes to TensorBoard and
can keep the best checkpoint of (`eval_summary_metrics` declares their names). The whole set's
probabilities are held in host memory (num_test x num_classes floats). Plain NumPy here, so the
example needs nothing more (tests/test_collect.py compares it with scikit-learn).
"""

import numpy as np
import tensorflow as tf

from engine.task import Task, classification_metrics


def macro_f1(labels, predictions, num_classes):
    """The mean over classes of F1 = 2 TP / (2 TP + FP + FN) (a class never seen nor predicted: 0)."""
    scores = []
    for c in range(num_classes):
        tp = np.sum((predictions == c) & (labels == c))
        wrong = np.sum((predictions == c) != (labels == c))  # FP + FN
        scores.append(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
    return float(np.mean(scores))


def binary_auc(positive, scores):
    """The area under the ROC curve: the probability that a positive scores above a negative
    (ties count half), from the average ranks (Mann-Whitney U)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    for start, end in zip(starts, ends):  # tied scores share their average rank (1-based)
        ranks[order[start:end]] = (start + end + 1) / 2
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def macro_auc(labels, probabilities):
    """One-vs-rest AUC averaged over the classes present (and absent) in `labels`."""
    classes = [c for c in range(probabilities.shape[1]) if 0 < np.sum(labels == c) < len(labels)]
    return float(np.mean([binary_auc(labels == c, probabilities[:, c]) for c in classes]))


class AucF1Task(Task):
    """The default classifier, with macro-F1 and one-vs-rest macro AUC over the whole eval set."""

    eval_summary_metrics = ("macro_f1", "macro_auc")

    def eval_step(self, batch):
        images, labels = batch
        logits = tf.cast(self.model(images, training=False), tf.float32)
        self.collect("probabilities", tf.nn.softmax(logits))  # [n, classes]: this replica's examples
        self.collect("labels", labels)
        return classification_metrics(labels, logits, self.per_example_loss(labels, logits))

    def eval_summary(self, collected):
        labels, probabilities = collected["labels"], collected["probabilities"]
        predictions = np.argmax(probabilities, axis=1)
        return {
            "macro_f1": macro_f1(labels, predictions, probabilities.shape[1]),
            "macro_auc": macro_auc(labels, probabilities),
        }
