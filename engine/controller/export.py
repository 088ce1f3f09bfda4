"""The exporters: the trained model as a Keras file and as a SavedModel for serving.

`export_saved_model` writes `<directory>/<version>/` with a `serving_default` signature that takes a
batch of the data's RAW examples (what the source holds, e.g. uint8 (n, 28, 28) images; the
normalised form when the source's raw form is unknown), applies the training pipeline's own
normalisation (engine/data/formats.py `normalise_features`, the same function, so the two cannot
drift apart), runs the model in inference mode and returns float32 class probabilities and the
predicted class (classifiers) or the model's outputs. It loads with plain `tf.saved_model.load` in
a process that never imports the engine. A version is written to a temporary sibling directory and
renamed into place, so a crash never leaves half a version behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from engine.data.formats import normalise_features


def export_keras(model, path: str) -> str:
    """model.save(path) (a `.keras` file, keras.models.load_model), creating its directory."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    model.save(path)
    return path


class _Serving(tf.Module):
    def __init__(self, model, raw: tf.TensorSpec, classifier: bool):
        super().__init__()
        self.model = model
        self.classifier = classifier
        self.serve = tf.function(self._serve, input_signature=[
            tf.TensorSpec([None, *raw.shape], raw.dtype, name="inputs")])

    def _serve(self, inputs):
        outputs = tf.cast(self.model(normalise_features(inputs), training=False), tf.float32)
        if self.classifier:
            return {"probabilities": tf.nn.softmax(outputs, axis=-1),
                    "classes": tf.argmax(outputs, axis=-1, output_type=tf.int64)}
        return {"outputs": outputs}


def export_saved_model(model, spec, directory: str, version: int, *, outputs: str = "probabilities") -> str:
    """Writes <directory>/<version>/ (see the module doc); returns its path. `spec`: the data's
    DataSpec; outputs="probabilities" returns softmax + classes for classifiers, "logits" the raw
    outputs as "outputs"."""
    raw = spec.raw_features or spec.features
    classifier = bool(spec.num_classes) and outputs == "probabilities"
    module = _Serving(model, raw, classifier)
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, str(version))
    staging = tempfile.mkdtemp(prefix=f".{version}-", dir=directory)
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": module.serve})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
