"""Everything stateful a Task holds, found the way tf.Module finds it: by walking its attributes.

Keras models and layers, optimizers, tf.Variables, tf.Modules and any other trackable object
reachable from a Task attribute (inside lists, tuples and dicts too) is state the checkpoint
holds; a Keras metric is held through its variables. The engine's own attributes (the main model
and optimizer, counters, config) are checkpointed by the engine and left out here.

What a checkpoint cannot hold (numpy arrays, Python numbers) is remembered as it was after the
build, so a change during training can be reported (`changed_untracked`): a resumed run would
silently start it again from that value.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers

import keras
import numpy as np

from engine import compat

# Set and checkpointed by the engine (engine/controller/state.py), or not state at all.
ENGINE_ATTRIBUTES = frozenset({"config", "spec", "model", "optimizer", "global_step", "updater", "total_steps", "seed"})


@dataclasses.dataclass
class TaskState:
    """What `find` found, keyed by attribute path ("discriminator", "teachers.0", "nets.gen")."""

    trackables: dict  # path -> an object tf.train.Checkpoint can hold
    models: dict  # path -> keras Layer (models included)
    optimizers: dict  # path -> keras optimizer
    untracked: dict  # path -> a copy of its value after the build (numpy arrays, Python numbers)

    def changed_untracked(self, task) -> list[str]:
        """Paths of untracked values that differ now from their value after the build."""
        now = find(task).untracked
        return [path for path, value in self.untracked.items() if path in now and not _same(value, now[path])]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
        )
    return a == b or (a != a and b != b)  # nan == nan here


def _walk(value, path, state: TaskState, seen: set) -> None:
    if isinstance(value, (str, bytes, bool)) or value is None:
        return
    if isinstance(value, (np.ndarray, np.generic)) or isinstance(value, numbers.Number):
        state.untracked[path] = copy.deepcopy(value)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(item, f"{path}.{i}", state, seen)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}.{str(key).replace('/', '_')}", state, seen)
        return
    if id(value) in seen:
        return
    if isinstance(value, (keras.metrics.Metric, keras.random.SeedGenerator)):  # not trackable themselves
        seen.add(id(value))
        state.trackables[path] = list(value.variables) if isinstance(value, keras.metrics.Metric) else [value.state]
        return
    if compat.is_trackable(value):
        seen.add(id(value))
        state.trackables[path] = value
        if isinstance(value, keras.optimizers.Optimizer):
            state.optimizers[path] = value
        elif isinstance(value, keras.layers.Layer):
            state.models[path] = value


def find(task) -> TaskState:
    """The Task's state outside the engine's own attributes (see the module doc)."""
    state = TaskState({}, {}, {}, {})
    seen = {id(task.model), id(task.optimizer)}
    for name, value in vars(task).items():
        if name not in ENGINE_ATTRIBUTES and not name.startswith("__"):
            _walk(value, name, state, seen)
    return state


def top_level_names(checkpoint_path: str, node: str) -> set[str]:
    """The names of the objects under the root's child `node` in a checkpoint's object graph (the
    Task state it holds); empty if it has none. (Variable keys cannot tell: a variable is stored
    once, under the first path that reaches it, e.g. a model's kernel under its optimizer's.)"""
    graph = compat.checkpoint_object_graph(checkpoint_path)
    children = {child.local_name: child.node_id for child in graph.nodes[0].children}
    if node not in children:
        return set()
    return {child.local_name for child in graph.nodes[children[node]].children}
