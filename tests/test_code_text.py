"""Measurements live in docs, reasons in code: no comment, docstring or help text in engine/, flags/
or run.py carries a benchmark figure (a time, a size, a percentage, an "Nx slower"). Figures belong
in docs/performance.md (or the page that owns the fact), where a benchmark regenerates them."""

from __future__ import annotations

import os
import re
import tokenize

import pytest
from helpers import REPO

pytestmark = pytest.mark.fast

FIGURE = re.compile(
    r"\b\d+(?:[.,]\d+)?\s?(?:%|ms|us|µs|KB|MB|GB|KiB|MiB|GiB|x (?:slower|faster))(?!\w)"
    r"|\b(?:a|one|\d+(?:\.\d+)?) (?:milli|micro)seconds?\b"
    r"|\b\d+(?:\.\d+)?\s?s (?:of CPU|a step|per step|each)"
)
# Figures that are not measurements: (file, the figure), each with why it may stay.
NOT_MEASURED = {
    ("engine/data/arrays.py", "2 GB"),  # TensorFlow's GraphDef size limit
    ("engine/data/text.py", "10%"),  # the held-out share of the text, a design choice
    ("engine/data/text.py", "0%"),  # a format spec ({TEST_FRACTION:.0%})
    ("engine/data/pipelines.py", "10 ms"),  # tf.data's autotune period, as TensorFlow sets it
    ("engine/models/classifiers.py", "85%"),  # the model's arithmetic (its multiply-adds), not a timing
}


def _texts(path):
    """(line, text) of every comment and string literal of a Python file."""
    with open(path, "rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(
                tokenize, "FSTRING_MIDDLE", -1
            ):
                yield token.start[0], token.string


def _sources():
    for top in ("engine", "flags"):
        for directory, _, files in os.walk(os.path.join(REPO, top)):
            yield from (os.path.join(directory, name) for name in sorted(files) if name.endswith(".py"))
    yield os.path.join(REPO, "run.py")


def test_no_benchmark_figures_in_code_text():
    found = []
    for path in _sources():
        where = os.path.relpath(path, REPO)
        for line, text in _texts(path):
            found += [
                f"{where}:{line}: {m.group(0)!r}"
                for m in FIGURE.finditer(text)
                if (where, m.group(0)) not in NOT_MEASURED
            ]
    assert not found, "figures belong in docs/performance.md (reasons stay in code):\n" + "\n".join(found)


def test_the_figure_pattern_finds_what_it_is_for():
    assert FIGURE.search("about 3x slower for the CNN") and FIGURE.search("+13 % on a 0.4 ms step")
    assert FIGURE.search("75 MB a run") and FIGURE.search("cost 1-2 s of CPU")
    assert FIGURE.search("about a millisecond per image")
    assert not FIGURE.search("a step of 64 examples") and not FIGURE.search("exit 138")
