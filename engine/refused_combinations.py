"""Flag combinations the engine refuses, and the model property they depend on.

Every combination of flags trains, except those listed in REFUSED (docs/failures.md lists them
with the reason and what to use instead). `check` is called once the Task's model exists (its layers decide) and before
anything is traced or trained; it raises one UserError naming the flags and what to use instead.
"""

from __future__ import annotations

from engine import compat
from engine.errors import UserError

# Strategies whose replica-context all-reduce is a merge_call, which TensorFlow refuses inside a
# nested tf.function (the XLA-compiled step).
MERGE_CALL_STRATEGIES = ("mirrored", "multi_worker_mirrored")


def cross_replica_layers(model) -> list[str]:
    """Names of the layers that all-reduce across replicas inside their call (Keras batch norm with
    synchronized=True): the engine runs such a model's micro-batches unrolled, not in a while_loop."""
    return [
        layer.name
        for layer in compat.flatten_layers(model, include_self=False)
        if getattr(layer, "synchronized", False)
    ]


def _xla_with_cross_replica_layers(config, model, layers):
    """--jit_compile + synchronised batch norm under a mirrored strategy: TensorFlow refuses the
    layer's merge_call inside the nested XLA-compiled function (one replica or many)."""
    if config.jit_compile and layers and config.strategy in MERGE_CALL_STRATEGIES:
        return (
            f"--jit_compile with --strategy={config.strategy}: model {model.name!r} has synchronised batch "
            f"norm ({', '.join(layers)}), whose all-reduce TensorFlow cannot run inside the XLA-compiled "
            "step; drop --jit_compile, or train on one device (--strategy=default)"
        )
    return None


def _loss_bound_with_skip(config, model, layers):
    """--loss_upper_bound judges the reduced loss, known only after the step's update: skipping
    would keep an update made from the spike; stop and rollback never keep it."""
    if config.loss_upper_bound and config.on_nonfinite == "skip":
        return (
            f"--loss_upper_bound={config.loss_upper_bound:g} with --on_nonfinite=skip: a loss spike is seen "
            "after its update, which skip would keep; use --on_nonfinite=rollback or stop"
        )
    return None


def _eager_with_compilation(config, model, layers):
    """--run_eagerly runs the loop as Python: there is no XLA-compiled step to build (TensorFlow
    would compile it, so the step would not be plain Python) and no traced graph to write."""
    compiled = [
        flag for flag, on in (("--jit_compile", config.jit_compile), ("--trace_graph", config.trace_graph)) if on
    ]
    if config.run_eagerly and compiled:
        return (
            f"--run_eagerly with {' and '.join(compiled)}: a step run as plain Python is neither XLA-compiled "
            "nor traced into a graph; drop one of them"
        )
    return None


# Rules (config, model, its cross-replica layers) -> the error message, or None when allowed.
# Append one to refuse another combination (and list it in docs/failures.md).
REFUSED = (_xla_with_cross_replica_layers, _loss_bound_with_skip, _eager_with_compilation)


def check(config, model) -> None:
    """Raises UserError for the first refused combination of `config` with `model`."""
    layers = cross_replica_layers(model)
    for rule in REFUSED:
        message = rule(config, model, layers)
        if message:
            raise UserError(message)
