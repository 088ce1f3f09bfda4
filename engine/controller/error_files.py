"""<model_dir>/errors/: where a failure's whole traceback goes when the console gets one line (a
failing host-side extra, a Task method that failed while being traced). Written by the chief only:
the other workers met the same failure and say where the chief's file is."""

from __future__ import annotations

import os
import time


def write(model_dir: str, stem: str, title: str, text: str, is_chief: bool = True) -> str:
    """<model_dir>/errors/<stem>-<time>.txt holding `title` and `text`; its path (or why it is not there)."""
    if not is_chief:
        return "the chief's <model_dir>/errors/"
    directory = os.path.join(model_dir, "errors")
    path = os.path.join(directory, f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{title}\n\n{text}")
    except OSError as write_error:
        return f"(not written: {write_error})"
    return path
