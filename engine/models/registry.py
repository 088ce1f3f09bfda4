"""Resolves `--model` to a keras.Model. Three forms:

- a registered name, a key of `MODELS` (add a model here);
- `package.module:function` or `path/to/file.py:function`: a function (input_shape, num_classes)
  returning a keras.Model that outputs logits; if it has a parameter named `spec`, it also gets the
  data's engine.data.spec.DataSpec (dtypes, class names) as the keyword `spec`;
- `keras.applications.NAME` (ResNet50, MobileNetV2, EfficientNetB0, ...): built untrained
  (`weights=None`) for the data's input shape and classes, outputting logits.
"""

from __future__ import annotations

import difflib
import inspect
import re

import keras

from engine.errors import UserError
from engine.models.classifiers import cnn_bn, mlp, seed_cnn
from engine.models.resnet import resnet20
from engine.user_code import load_object

MODELS = {"cnn": seed_cnn, "cnn_bn": cnn_bn, "mlp": mlp, "resnet20": resnet20}

APPLICATIONS = "keras.applications."
FORMS = "package.module:function, path/to/file.py:function or keras.applications.NAME"


def build_model(name: str, input_shape, num_classes: int, spec=None) -> keras.Model:
    """The `--model=name` network for examples of `input_shape` and `num_classes` classes; `spec`
    (the data's DataSpec) goes to a builder that has a `spec` parameter."""
    input_shape = tuple(input_shape)
    if name.startswith(APPLICATIONS):
        return _application(name, input_shape, num_classes)
    if name in MODELS:
        builder = MODELS[name]
    elif ":" in name:
        builder = load_object(name, "model", name)
    else:
        raise UserError(f"unknown --model={name!r}; use a registered name ({', '.join(sorted(MODELS))}), {FORMS}")
    if not callable(builder):
        raise UserError(
            f"--model={name!r}: {type(builder).__name__} is not a function (input_shape, num_classes) -> keras.Model"
        )
    kwargs = {"spec": spec} if _takes_spec(builder) else {}
    try:
        inspect.signature(builder).bind(input_shape, num_classes, **kwargs)
    except TypeError as err:
        raise UserError(f"--model={name!r}: cannot call it as function(input_shape, num_classes): {err}") from None
    except ValueError:  # no signature to check (a builtin): just call it
        pass
    model = builder(input_shape, num_classes, **kwargs)
    if not isinstance(model, keras.Model):
        raise UserError(f"--model={name!r} returned {type(model).__name__}, not a keras.Model")
    return model


def _takes_spec(builder) -> bool:
    try:
        return "spec" in inspect.signature(builder).parameters
    except (TypeError, ValueError):  # no signature (a builtin): it cannot ask for the spec
        return False


def application_names() -> list:
    return sorted(n for n in dir(keras.applications) if n[:1].isupper() and callable(getattr(keras.applications, n)))


def _application(name: str, input_shape: tuple, num_classes: int) -> keras.Model:
    """keras.applications.NAME, untrained, for this data, with logits out. Where the application
    has its own input preprocessing (rescaling from [0, 255]), it is off: the engine's images are
    already scaled to [0, 1]."""
    app = name[len(APPLICATIONS) :]
    if app not in application_names():
        close = difflib.get_close_matches(app, application_names(), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(
            f"--model={name!r}: keras.applications has no model {app!r}{hint}; valid: {', '.join(application_names())}"
        )
    shape = "x".join(str(d) for d in input_shape)
    if len(input_shape) != 3:
        raise UserError(
            f"--model={name!r}: {app} takes images (height, width, channels); "
            f"this data's examples have shape {input_shape}"
        )
    builder = getattr(keras.applications, app)
    options = dict(weights=None, input_shape=input_shape, classes=num_classes, classifier_activation=None)
    if "include_preprocessing" in inspect.signature(builder).parameters:
        options["include_preprocessing"] = False
    try:
        return builder(**options)
    except ValueError as err:
        smallest = re.search(r"at least (\d+x\d+)", str(err))
        if smallest:
            raise UserError(
                f"--model={name!r}: {app} needs input at least {smallest.group(1)} "
                f"(this data's examples are {shape}); resize the images "
                "(--image_size=H,W for images:DIR and tfrecord data)"
            ) from None
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--model={name!r}: {app} refuses input shape {shape}: {first_line}") from None
