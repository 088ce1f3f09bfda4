"""docs/flags.md, the flags reference, generated from the flag definitions (engine/config.py's fields).

    python -m flags.reference            rewrite docs/flags.md
    python -m flags.reference --check    exit 1 when docs/flags.md differs from the definitions

tests/test_docs.py fails when the page is stale, so a changed flag (name, default, help text,
bounds) is a changed page in the same commit.
"""

from __future__ import annotations

import argparse
import os
import sys

from absl import flags as absl_flags

from flags.definitions import SECTIONS, define_flags

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "flags.md")

_HEADER = """# Flags reference

Generated from `engine/config.py` (each flag is a `Config` field) by `python -m flags.reference`; do not edit by hand
(`tests/test_docs.py` fails when this page and the definitions differ). `python run.py --help`
prints the same; `--flagfile=FILE` reads flags from a file, one `--name=value` per line. A step is
one global batch (one optimizer update); times are seconds."""


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, `<` as an entity (so <model_dir> is not read as HTML)."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _help(flag) -> str:
    """The help text without the "<a|b|c>: " that absl puts before an enum's own."""
    values = getattr(getattr(flag, "parser", None), "enum_values", None)
    prefix = f"<{'|'.join(values)}>: " if values else ""
    return flag.help[len(prefix) :] if prefix and flag.help.startswith(prefix) else flag.help


def _default(flag) -> str:
    if flag.default is None:
        return "none"
    if flag.flag_type() == "bool":
        return "`true`" if flag.default else "`false`"
    return f"`{flag.default_as_str.strip(chr(39))}`" if flag.default_as_str.strip("'") else "empty"


def _kind(flag) -> str:
    values = getattr(getattr(flag, "parser", None), "enum_values", None)
    if values:
        return "one of " + ", ".join(f"`{value}`" for value in values)
    bounds = []
    parser = getattr(flag, "parser", None)
    for attribute, sign in (("lower_bound", ">="), ("upper_bound", "<=")):
        bound = getattr(parser, attribute, None)
        if bound is not None:
            bounds.append(f"{sign} {bound}")
    return flag.flag_type() + (f" ({', '.join(bounds)})" if bounds else "")


def render() -> str:
    """The whole page, from a fresh FlagValues with every engine flag defined."""
    flag_values = absl_flags.FlagValues()
    define_flags(flag_values)
    every = [(name, flag_values[name]) for name in flag_values]  # in definition order
    firsts = {first: heading for heading, first in SECTIONS}
    names = [name for name, _ in every]
    missing = [first for first in firsts if first not in names]
    if missing or names[0] not in firsts:
        raise ValueError(
            f"flags/definitions.py SECTIONS names flags that are not first in definition order: {missing or names[0]}"
        )
    lines = [_HEADER]
    for name, flag in every:
        if name in firsts:
            lines += ["", f"## {firsts[name]}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        spelled = f"`--[no]{name}`" if flag.flag_type() == "bool" else f"`--{name}`"
        lines.append(f"| {spelled} | {_cell(_kind(flag))} | {_default(flag)} | {_cell(_help(flag))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/flags.md is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = open(PAGE, encoding="utf-8").read() if os.path.exists(PAGE) else ""
        if current != page:
            print(f"{PAGE} is stale: run `python -m flags.reference`", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(PAGE), exist_ok=True)
    with open(PAGE, "w", encoding="utf-8") as out:
        out.write(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
