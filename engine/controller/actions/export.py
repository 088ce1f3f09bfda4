"""At the end of training, on the chief: the trained model in each of --export_formats,
  keras        <model_dir>/export/model.keras (keras.models.load_model)
  saved_model  <model_dir>/export/saved_model/<step>/ with a serving_default signature that takes
               the data's raw examples (docs/serving.md)
With --ema_decay the EMA weights are exported (the line says so). A Task may choose what is
exported (e.g. a GAN's generator) by overriding `Task.export_model()`."""

from __future__ import annotations

import os

from engine.controller import export as exporters
from engine.controller.actions.base import Action, ActionContext


def parse_formats(text: str) -> tuple:
    from engine.config import EXPORT_FORMATS, export_format_list
    from engine.errors import UserError

    formats = export_format_list(text)
    if formats is None:
        raise UserError(f"--export_formats={text!r}: use a comma-separated list of {', '.join(EXPORT_FORMATS)}")
    return formats


class Export(Action):
    name = "the export"
    key = "export"

    def __init__(self, config):
        self.formats = parse_formats(config.export_formats)

    def at_end(self, context: ActionContext) -> tuple | None:
        """The exported paths, in --export_formats order (the chief's; None on other workers)."""
        if not context.is_chief:
            return None
        config, step = context.config, context.step
        directory = os.path.join(config.model_dir, "export")
        model = context.task.export_model()
        paths = []
        with context.export_weights():
            if "keras" in self.formats:
                keras_path = os.path.join(directory, "model.keras")
                if exporters.export_keras(model, keras_path):
                    paths.append(keras_path)
                else:
                    context.message(
                        f"export: {keras_path} was written but does not load back with keras.models.load_model "
                        f"({exporters.unloadable(keras_path)}); --export_formats=saved_model exports a model "
                        "that serves (docs/serving.md)"
                    )
            if "saved_model" in self.formats:
                paths.append(
                    exporters.export_saved_model(model, context.data_spec, os.path.join(directory, "saved_model"), step)
                )
        if len(paths) > 1 or config.ema_decay:
            context.message("export " + ", ".join(paths) + (" (EMA weights)" if config.ema_decay else ""))
        return tuple(paths)
