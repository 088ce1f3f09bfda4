"""The code's shape: engine/ imports without cycles (lazy imports inside functions included), data
never imports the Task, the module map in the package docstrings names every module, and no test
module imports another test module (shared helpers live in tests/helpers.py)."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from helpers import REPO


def _modules(package: str) -> dict:
    """{dotted module name: path} of every .py file under REPO/package."""
    modules = {}
    for path in pathlib.Path(REPO, package).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path) -> set:
    """Every module name an `import` or `from ... import` anywhere in the file may load."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph(package: str) -> dict:
    modules = _modules(package)
    return {
        name: {other for other in _imports(path) if other in modules and other != name}
        for name, path in modules.items()
    }


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                return stack[stack.index(other) :] + [other]
            if other not in state:
                found = visit(other)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_engine_has_no_import_cycle():
    graph = _graph("engine")
    assert len(graph) > 40
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.fast
def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_data_never_imports_the_task_or_the_controller():
    graph = _graph("engine")
    for name, imported in graph.items():
        if name.startswith("engine.data"):
            back = {m for m in imported if m == "engine.task" or m.startswith(("engine.tasks", "engine.controller"))}
            assert not back, f"{name} imports {sorted(back)}"


@pytest.mark.parametrize(
    "package",
    [
        "engine",
        "engine.controller",
        "engine.data",
        "engine.distribute",
        "engine.observe",
        "engine.tasks",
        "engine.models",
    ],
)
def test_module_map_names_every_module(package):
    """The package docstrings are the module map (BUILD.md points to them): each names its modules."""
    directory = pathlib.Path(REPO, *package.split("."))
    doc = ast.get_docstring(ast.parse((directory / "__init__.py").read_text()))
    missing = [
        path.name for path in sorted(directory.glob("*.py")) if path.name != "__init__.py" and path.name not in doc
    ]
    subpackages = [
        path.name + "/"
        for path in sorted(directory.iterdir())
        if (path / "__init__.py").exists() and path.name + "/" not in doc
    ]
    assert not missing + subpackages, f"{package}'s docstring does not name {missing + subpackages}"


def test_no_test_module_imports_another():
    tests = {path.stem for path in pathlib.Path(REPO, "tests").glob("test_*.py")} | {"conftest"}
    offenders = {path.name: sorted(_imports(path) & tests) for path in pathlib.Path(REPO, "tests").glob("*.py")}
    assert not {name: found for name, found in offenders.items() if found}


def test_flags_package_does_not_import_tensorflow():
    """flags/ is imported before TensorFlow loads (bad flags fail in a second)."""
    for path in pathlib.Path(REPO, "flags").glob("*.py"):
        assert not {m for m in _imports(path) if m.split(".")[0] in ("tensorflow", "keras")}, path.name
    assert os.path.exists(os.path.join(REPO, "flags", "reference.py"))
