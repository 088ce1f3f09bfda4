"""The exporters: the trained model as a Keras file and as a SavedModel for serving.

`export_saved_model` writes `<directory>/<version>/` with a `serving_default` signature that takes a
batch of the data's RAW examples (what the source holds, e.g. uint8 (n, 28, 28) images; the
normalised form when the source's raw form is unknown), applies the training pipeline's own
normalisation (engine/data/formats.py `normalise_features`, the same function, so the two cannot
drift apart), runs the model in inference mode and returns float32 class probabilities and the
predicted class (classifiers) or the model's outputs. It loads with plain `tf.saved_model.load` in
a process that never imports the engine. A version is written to a temporary sibling directory and
renamed into place, so a crash never leaves half a version behind.

A model that does not take the data's examples (a Task's `export_model()`, e.g. a GAN's generator
taking latent vectors) is served on its own input, without the data's normalisation.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras
import tensorflow as tf

from engine.data.formats import normalise_features

OUTPUTS = ("probabilities", "logits")


def export_keras(model, path: str) -> str | None:
    """model.save(path) (a `.keras` file, keras.models.load_model), creating its directory; then
    loads it back, since a saved file is not always a loadable one (a Lambda layer, an unregistered
    custom layer). Returns None when it does not load: `unloadable(path)` says why."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    model.save(path)
    return None if unloadable(path) else path


def unloadable(path: str) -> str:
    """Why keras.models.load_model(path) fails, in one line; empty when it loads."""
    try:
        keras.models.load_model(path, compile=False)
    except Exception as err:  # any failure means the file does not serve as an export
        return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return ""


def _own_input(model, spec):
    """The model's single declared input when it does not take the data's normalised examples
    (e.g. a generator of latent vectors), else None."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed model that declares no inputs
        return None
    if not inputs or len(inputs) != 1:
        return None
    shape = tf.TensorShape(inputs[0].shape[1:])
    return None if shape.is_compatible_with(spec.features.shape) else tf.TensorSpec(shape, inputs[0].dtype)


class _Serving(tf.Module):
    def __init__(self, model, signature_input: tf.TensorSpec, normalise: bool, num_classes):
        super().__init__()
        self.model = model
        self._normalise, self._num_classes = normalise, num_classes
        self.serve = tf.function(
            self._serve,
            input_signature=[tf.TensorSpec([None, *signature_input.shape], signature_input.dtype, name="inputs")],
        )

    def _serve(self, inputs):
        x = normalise_features(inputs) if self._normalise else inputs
        outputs = self.model(x, training=False)
        if isinstance(outputs, (dict, list, tuple)):  # several outputs: outputs_0, outputs_1, ...
            flat = tf.nest.flatten(outputs)
            return {f"outputs_{i}": tf.cast(o, tf.float32) if o.dtype.is_floating else o for i, o in enumerate(flat)}
        if outputs.dtype.is_floating:
            outputs = tf.cast(outputs, tf.float32)  # mixed precision computes in (b)float16
        if self._num_classes and outputs.shape[-1] == self._num_classes:
            return {
                "probabilities": tf.nn.softmax(outputs, axis=-1),
                "classes": tf.argmax(outputs, axis=-1, output_type=tf.int64),
            }
        return {"outputs": outputs}


def serving_module(model, spec, outputs: str = "probabilities") -> _Serving:
    """The module export_saved_model writes, its `serve` not traced yet (the preflight traces it)."""
    if outputs not in OUTPUTS:
        raise ValueError(f"export_saved_model(outputs={outputs!r}): expected one of {', '.join(OUTPUTS)}")
    own = _own_input(model, spec)
    signature_input = own or spec.raw_features or spec.features
    num_classes = spec.num_classes if outputs == "probabilities" and own is None else None
    return _Serving(model, signature_input, normalise=own is None, num_classes=num_classes)


def export_saved_model(model, spec, directory: str, version: int, *, outputs: str = "probabilities") -> str:
    """Writes <directory>/<version>/ (see the module doc) and returns its path.

    `spec`: the data's DataSpec (engine/data/spec.py); the signature takes a batch of
    `spec.raw_features` (or `spec.features` when that is None) named "inputs".
    `outputs`: "probabilities" returns {"probabilities": float32 softmax, "classes": int64 argmax}
    for a classifier (spec.num_classes set and the model's last axis that wide), else
    {"outputs": float32 model outputs}; "logits" always returns {"outputs": ...}.
    An existing <version> is replaced."""
    module = serving_module(model, spec, outputs)
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, str(int(version)))
    # Hidden, non-numeric names: TF Serving only loads numbered version directories.
    staging = tempfile.mkdtemp(prefix=f".{version}-writing-", dir=directory)
    old = None
    try:
        tf.saved_model.save(module, staging, signatures={"serving_default": module.serve})
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=f".{version}-replaced-", dir=directory)
            os.replace(final, os.path.join(old, "version"))
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    return final
