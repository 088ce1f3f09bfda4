"""What a Task learns of its data: per-example shapes and dtypes, and the classes when there are any."""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """One example as the training step sees it (after decoding and normalisation).

    features: tf.TensorSpec of one example's input (e.g. (28, 28, 1) float32 images in [0, 1],
              or (seq_len,) int32 tokens); labels: tf.TensorSpec of its target (() int32 class ids,
              or float targets for a regression Task); num_classes: how many classes (None when the
              labels are not classes); class_names: their names when the source knows them;
              raw_features: one example as the source holds it before the engine's normalisation
              (e.g. (28, 28) uint8), when known: what a SavedModel export's signature takes.
    """

    features: tf.TensorSpec
    labels: tf.TensorSpec
    num_classes: Optional[int] = None
    class_names: Optional[tuple] = None
    raw_features: Optional[tf.TensorSpec] = None

    @classmethod
    def classification(cls, input_shape, num_classes: int, class_names=None, raw_features=None) -> "DataSpec":
        return cls(
            tf.TensorSpec(tuple(input_shape), tf.float32),
            tf.TensorSpec((), tf.int32),
            num_classes,
            tuple(class_names) if class_names else None,
            raw_features,
        )

    @classmethod
    def of(cls, element_spec, num_classes=None, class_names=None, raw_features=None) -> "DataSpec":
        """From a tf.data element_spec of (features, labels) examples (unbatched); `raw_features`:
        one example before normalisation, when the source knows it."""
        features, labels = element_spec
        return cls(
            tf.TensorSpec(features.shape, features.dtype),
            tf.TensorSpec(labels.shape, labels.dtype),
            num_classes,
            tuple(class_names) if class_names else None,
            raw_features,
        )

    @property
    def input_shape(self) -> tuple:
        return tuple(self.features.shape)

    @property
    def is_image(self) -> bool:
        """float (height, width, 1 or 3) examples: shown as pictures in TensorBoard."""
        shape = self.input_shape
        return len(shape) == 3 and shape[-1] in (1, 3) and self.features.dtype.is_floating

    def describe(self) -> str:
        kind = "images" if self.is_image else "features"
        classes = f", {self.num_classes} classes" if self.num_classes else ""
        if self.class_names:
            shown = self.class_names[:10]
            classes += f" ({', '.join(shown)}{', ...' if len(self.class_names) > len(shown) else ''})"
        return (
            f"{kind} {self.input_shape} {self.features.dtype.name}, labels {tuple(self.labels.shape)} "
            f"{self.labels.dtype.name}{classes}"
        )
