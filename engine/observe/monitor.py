"""What the chief shows in TensorBoard beyond the per-loop scalars, decided between compiled loops:
config text, sample inputs, HParams session, the Custom Scalars layout; at each evaluation the
confusion matrix, per-class accuracy, misclassified examples and per-class PR curves (and the Task's
own `after_eval` extras); the traced train-step graph and the profiler window. (Histograms:
engine/controller/actions/histograms.py; the pictures: engine/observe/pictures.py.)

Nothing here runs a collective: on other workers the writers do nothing and the chief-only work
(predictions for the images, the profiler) is skipped, so they never wait on it except at the next
collective of the training loop.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from engine import __version__
from engine.observe import layout, pictures, pr_curves
from engine.errors import UserError
from engine.observe.hparams import hparam_values

SAMPLE_INPUTS = 24  # training images in the start-up grid
MISCLASSIFIED = 24  # wrong test predictions shown per evaluation
PREDICT_BATCH = 1000


def parse_profile_steps(text: str) -> tuple | None:
    """'START,END' -> (START, END) with 0 <= START < END; '' -> None."""
    if not text:
        return None
    try:
        start, end = (int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--profile_steps={text!r}: expected START,END, two step numbers like 100,120") from None
    if not 0 <= start < end:
        raise UserError(f"--profile_steps={text!r}: need 0 <= START < END")
    return start, end


def class_names_markdown(names, counts) -> str:
    """The confusion matrix's class numbers with their names, test examples and recall, as a table."""
    rows = []
    for i, name in enumerate(names):
        total = int(counts[i].sum())
        cell = str(name).replace("|", "&#124;")  # a "|" in a folder name would split the cell
        rows.append(f"| {i} | {cell} | {total} | {counts[i, i] / max(total, 1):.3f} |")
    return "| class | name | test examples | recall |\n|---|---|---|---|\n" + "\n".join(rows)


class Monitor:
    """Chief-side TensorBoard extras for one run; every method is a no-op where it has no effect."""

    def __init__(self, config, writers, task, data, *, is_chief: bool):
        self.config, self.writers, self.task, self.data = config, writers, task, data
        self.is_chief = is_chief
        self.full = config.summaries == "full"
        self.profile = parse_profile_steps(config.profile_steps)
        self._profiling = False
        self._predict = None
        self.pictures_off = None  # why the classification pictures are off (check_pictures), or None

    @property
    def marks(self) -> tuple:
        """Steps that must end a compiled loop (the profiled window)."""
        return self.profile or ()

    # ---- start of a fresh run ----
    def at_start(self, text: str, extra_hparams: dict) -> None:
        train, evaluation = self.writers["train"], self.writers["eval"]
        train.write_text(0, "config", text)
        train.write_text(0, "engine_version", f"ctl-engine {__version__}")
        if not self.full:
            return
        if self.data.spec.is_image:
            images, labels = self.data.preview(min(SAMPLE_INPUTS, self.data.num_train))
            if labels.ndim == 1:
                names = pictures.names_of(
                    self.data.spec.num_classes or int(labels.max()) + 1, self.data.spec.class_names
                )
                train.write_figure(
                    0,
                    "sample_inputs",
                    pictures.image_grid_figure(images, [names[int(label)] for label in labels]),
                    description="The first training images with their labels (before shuffling).",
                )
        train.write_tensor(
            0,
            *layout.layout_summary(
                dict.fromkeys([*self.task.train_metrics, *self.task.eval_metrics]),
                loss_scale=self.config.precision == "mixed_float16",
            ),
        )
        flags = {k: v for k, v in self.config.as_dict().items() if k != "model_dir"}
        extra_hparams = {k: v for k, v in extra_hparams.items() if k != "class_names"}  # a list, not a knob
        evaluation.write_hparams(
            hparam_values(flags, extra_hparams),
            (*self.task.eval_metrics, *self.task.eval_summary_metrics),
            trial_id=os.path.basename(os.path.normpath(self.config.model_dir)),
        )

    # ---- around compiled loops ----
    def before_loop(self, step: int, first_call: bool) -> None:
        if first_call and self.config.trace_graph:
            self.writers["train"].start_graph_trace()
        if self.is_chief and self.profile and step == self.profile[0] and not self._profiling:
            tf.profiler.experimental.start(os.path.join(self.config.model_dir, "train"))
            self._profiling = True

    def after_loop(self, step: int, first_call: bool) -> None:
        if first_call and self.config.trace_graph:
            self.writers["train"].write_graph_trace(step, "train_loop")
        if self._profiling and step >= self.profile[1]:
            self.stop_profiler()

    def stop_profiler(self) -> None:
        if self._profiling:
            tf.profiler.experimental.stop()
            self._profiling = False

    # ---- at each evaluation ----
    def after_eval(self, step: int) -> None:
        if not (self.full and self.is_chief):
            return
        self.task.after_eval(step, self.writers["eval"])  # the Task's own extras (default: none)
        found = self._predictions()
        if found is None:
            return
        labels, probabilities, wrong_images = found
        predictions = probabilities.argmax(axis=-1)
        num_classes, names = self.data.spec.num_classes, self.data.spec.class_names
        counts = pictures.confusion_counts(labels, predictions, num_classes)
        writer = self.writers["eval"]
        writer.write_figure(
            step,
            "confusion_matrix",
            pictures.confusion_figure(counts, names),
            description=(
                f"Rows: true class, columns: predicted, over all {len(labels)} test examples; colour: the "
                "fraction of the true class (each row sums to 1)."
            ),
        )
        writer.write_figure(
            step,
            "per_class_accuracy",
            pictures.per_class_accuracy_figure(counts, names),
            description="Each class's accuracy (recall) on its test examples.",
        )
        for tag, curve, meta in pr_curves.summaries(labels, probabilities, pictures.names_of(num_classes, names)):
            writer.write_tensor(step, tag, curve, meta)
        if names:
            writer.write_text(step, "class_names", class_names_markdown(names, counts))
        wrong = np.flatnonzero(labels != predictions)[: len(wrong_images)]
        pairs = [(int(labels[i]), int(predictions[i])) for i in wrong]
        if pairs:
            writer.write_figure(
                step,
                "misclassified",
                pictures.misclassified_figure(np.asarray(wrong_images), *zip(*pairs), names, num_classes),
                description=(
                    f"The first {MISCLASSIFIED} wrong test predictions with their true and predicted classes; "
                    "the text misclassified_labels of the same step lists them."
                ),
            )
        writer.write_text(
            step,
            "misclassified_labels",
            (
                f"{int((labels != predictions).sum())} of {len(labels)} test images wrong; the first "
                f"{len(pairs)} (true>predicted): "
                + ", ".join(f"{t}>{p}" + (f" ({names[t]}>{names[p]})" if names else "") for t, p in pairs)
            ),
        )

    def draws_pictures(self) -> bool:
        spec = self.data.spec
        wanted = getattr(self.task, "is_classifier", True) and spec.num_classes and spec.labels.shape.rank == 0
        return bool(wanted and self.pictures_off is None)

    def check_pictures(self) -> str:
        """Before training, on one test example: "" when the classification pictures will work, else
        why they are off (then they stay off), so a model they do not fit never fails after training."""
        if not (self.full and self.is_chief and self.draws_pictures()):
            return ""
        try:
            self._predict = self._predict_function()
            features, _ = next(iter(self.data.test_batches(1)))
            probabilities = self._predict(features).numpy()
        except UserError:
            raise
        except Exception as err:  # any model the pictures cannot use: off, with its reason
            self.pictures_off = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
            return self.pictures_off
        if probabilities.ndim != 2 or probabilities.shape[-1] != self.data.spec.num_classes:
            self.pictures_off = (
                f"the model's output has shape {list(probabilities.shape)}, not one logit per class "
                f"({self.data.spec.num_classes}); set is_classifier = False or classifier_output"
            )
        return self.pictures_off or ""

    def _predict_function(self):
        model, spec, choice = self.task.model, self.data.spec, getattr(self.task, "classifier_output", None)

        # autograph off: a bad classifier_output's error then reaches the user as raised (one line).
        @tf.function(input_signature=[tf.TensorSpec([None, *spec.input_shape], spec.features.dtype)], autograph=False)
        def predict(x):
            return tf.nn.softmax(tf.cast(class_logits(model, model(x, training=False), choice), tf.float32))

        return predict

    def _predictions(self):
        """(labels, class probabilities, the first wrong images) over every test example, from the
        chief's local copy of the weights: a plain forward pass outside strategy.run reads mirrored
        variables locally (no collective). None when the data has no classes or the model's outputs
        are not one logit per class (a custom Task), or the Task says it is no classifier."""
        if not self.draws_pictures():
            return None
        spec = self.data.spec
        if self._predict is None:
            self._predict = self._predict_function()
        all_labels, all_probabilities, wrong_images = [], [], []
        for features, labels in self.data.test_batches(PREDICT_BATCH):
            probabilities = self._predict(features).numpy()
            if probabilities.ndim != 2 or probabilities.shape[-1] != spec.num_classes:
                return None
            predictions = probabilities.argmax(axis=-1)
            if spec.is_image and len(wrong_images) < MISCLASSIFIED:
                wrong_images.extend(features[labels != predictions][: MISCLASSIFIED - len(wrong_images)])
            all_labels.append(labels)
            all_probabilities.append(probabilities)
        return np.concatenate(all_labels), np.concatenate(all_probabilities), wrong_images


def class_logits(model, outputs, choice):
    """The class logits among a model's outputs: the only output, or `choice` (Task.classifier_output:
    an index, an output name or a dict key) of several."""
    if not isinstance(outputs, (list, tuple, dict)):
        return outputs
    if choice is None:
        raise ValueError(f"the model has {len(outputs)} outputs and the Task names none of them as classifier_output")
    names = list(outputs) if isinstance(outputs, dict) else list(getattr(model, "output_names", []) or [])
    if isinstance(outputs, dict) or isinstance(choice, str):
        if choice not in names:
            raise UserError(f"classifier_output={choice!r} is not one of the model's outputs {names}")
        return outputs[choice] if isinstance(outputs, dict) else outputs[names.index(choice)]
    if not -len(outputs) <= choice < len(outputs):
        raise UserError(f"classifier_output={choice!r}: the model has {len(outputs)} outputs")
    return outputs[choice]
