"""BUILD.md names only what exists: every repository path it names exists (test files included),
and every symbol it names beside a module's path (`engine/x.py` (`name`, `other`), `NAME` in
`engine/x.py`, `NAME` (`engine/x.py`)) is defined in that module. Modules are parsed with ast,
never imported."""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

from helpers import REPO

pytestmark = pytest.mark.fast

# A name the repository holds: a file with one of these endings anywhere, or anything under one of
# the repository's top-level entries (`checkpoints/` or `task/` are a run directory's, not ours).
EXTENSIONS = (".py", ".md", ".cfg", ".toml", ".yaml", ".yml", ".json")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
IDENT = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
SYMBOL = re.compile(rf"`({IDENT})(?:\(\))?`")
MODULE = r"`([\w./-]+\.py)`"
# the second form: `NAME` in `module.py`, `NAME` of `module.py`, `NAME` (`module.py`)
SYMBOL_BEFORE_MODULE = re.compile(rf"`({IDENT})(?:\(\))?`(?: in | of | \(){MODULE}")
# plain-text paths under the source folders (the ones outside backticks)
PLAIN_PATH = re.compile(r"(?<![\w/.`-])((?:engine|flags|tests|benchmarks|docs|deploy|examples)/[\w./-]*[\w/])")


def _read(path) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def _is_repository_path(name: str) -> bool:
    if not PATH.fullmatch(name):
        return False
    if name.endswith(EXTENSIONS):
        return True
    return "/" in name and os.path.exists(os.path.join(REPO, name.split("/")[0]))


def named_paths(text: str) -> set:
    spans = set(re.findall(r"`([^`\n]+)`", text))
    outside = re.sub(r"`[^`\n]+`", "", text)
    return {span for span in spans if _is_repository_path(span)} | set(PLAIN_PATH.findall(outside))


def named_symbols(text: str) -> set:
    """(module path, symbol) for `module.py` (`name`, `other`, ...: the names at the start of the
    parenthesis, up to the first that is not followed by a comma) and for the second form."""
    found = set()
    for match in re.finditer(MODULE + r" \(", text):
        rest = text[match.end() :]
        while (symbol := SYMBOL.match(rest)) is not None:
            found.add((match.group(1), symbol.group(1)))
            rest = rest[symbol.end() :]
            if not rest.startswith(", "):
                break
            rest = rest[2:]
    found |= {(module, symbol) for symbol, module in SYMBOL_BEFORE_MODULE.findall(text)}
    return found


@functools.lru_cache(maxsize=None)
def _definitions(module: str) -> dict:
    """{top-level name: its ast node} of a module: functions, classes and assigned names."""
    defined = {}
    for node in ast.parse(_read(module)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, ast.Assign):
            defined.update((target.id, node) for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined[node.target.id] = node
    return defined


def is_defined(module: str, symbol: str) -> bool:
    """`symbol` (`name` or `Class.attribute`) is defined at the top of `module` (or in its class)."""
    first, *rest = symbol.split(".")
    node = _definitions(module).get(first)
    for name in rest:
        if not isinstance(node, ast.ClassDef):
            return False
        members = {}
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                members[child.name] = child
            elif isinstance(child, ast.Assign):
                members.update((t.id, child) for t in child.targets if isinstance(t, ast.Name))
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                members[child.target.id] = child
        node = members.get(name)
    return node is not None


def missing_names(text: str) -> list:
    """Every path that does not exist and every symbol its module does not define, as strings."""
    missing = sorted(path for path in named_paths(text) if not os.path.exists(os.path.join(REPO, path)))
    for module, symbol in sorted(named_symbols(text)):
        if not os.path.isfile(os.path.join(REPO, module)):
            continue  # reported as a missing path
        if not is_defined(module, symbol):
            missing.append(f"{symbol} in {module}")
    return missing


def test_every_path_and_symbol_build_md_names_exists():
    missing = missing_names(_read("BUILD.md"))
    assert not missing, f"BUILD.md names what is not there: {missing}"


def test_the_parser_finds_build_md_s_names():
    """Not vacuous: the test above reads the paths, test files and symbols BUILD.md is made of."""
    text = _read("BUILD.md")
    paths, symbols = named_paths(text), named_symbols(text)
    assert {"engine/controller/state.py", "tests/test_eval_mode.py", "setup.cfg", ".ci/run"} <= paths
    assert not {"checkpoints/", "task/", "run:entry_point"} & paths  # a run's paths, an entry point
    assert {
        ("engine/controller/state.py", "build_task"),
        ("engine/controller/state.py", "create_state"),
        ("engine/models/registry.py", "MODELS"),
        ("engine/data/sources.py", "SOURCE_KINDS"),
        ("engine/controller/trainer.py", "Trainer.run_loop"),
    } <= symbols
    assert ("engine/controller/checkpoints.py", "writable") not in symbols  # `writable=False` is an argument


def test_a_wrong_name_is_reported():
    text = (
        "`engine/controller/state.py` (`build_task`, `no_such_function`), `NO_SUCH` in `engine/models/registry.py`, "
        "`engine/controller/trainer.py` (`_Run.no_such_method`'s), `tests/test_no_such_file.py`, engine/no_such/"
    )
    assert missing_names(text) == [
        "engine/no_such/",
        "tests/test_no_such_file.py",
        "no_such_function in engine/controller/state.py",
        "_Run.no_such_method in engine/controller/trainer.py",
        "NO_SUCH in engine/models/registry.py",
    ]
