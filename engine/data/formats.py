"""Shape and format helpers every source shares (a leaf module: TensorFlow and errors only).

normalise_features / normalise_labels   the engine's one normalisation of raw examples
parse_shape                             "32,32,3" -> (32, 32, 3), with a one-line error
with_options                            the tf.data options of every pipeline the engine builds
augmented_spec                          one example's structure after a Task's augmentation, or a one-line refusal
describe_structure                      such a structure in one line
check_example_pair                      a parser's or own pipeline's example is (features, label), or one line
augment_each                            a Task's per-example augmentation over a batch
"""

from __future__ import annotations

import tensorflow as tf

from engine.errors import UserError


def normalise_features(x, batched: bool = True, on_cpu: bool = False):
    """uint8 -> float32 in [0, 1] (images; (H, W) grey images gain a channel axis), other floats
    -> float32, other integers -> int32 (e.g. token ids).

    on_cpu: the op runs on a CPU (a tf.data map, arrays resident on CPU devices): uint8 is scaled in
    one pass by Dequantize, a CPU-only kernel whose result is bit-identical to the cast and
    multiply (every one of the 256 values: tests/test_data.py) in one pass instead of two, which
    shows on a short step (docs/performance.md, "Where an engine step's time goes")."""
    if x.dtype == tf.uint8:
        if on_cpu:
            x = tf.raw_ops.Dequantize(input=tf.bitcast(x, tf.quint8), min_range=0.0, max_range=1.0, mode="MIN_COMBINED")
        else:
            x = tf.cast(x, tf.float32) * (1.0 / 255.0)
        return x[..., tf.newaxis] if x.shape.rank == 2 + batched else x
    return tf.cast(x, tf.float32 if x.dtype.is_floating else tf.int32)


def normalise_labels(y):
    """Integer labels -> int32 class ids; float labels -> float32 regression targets."""
    return tf.cast(y, tf.float32 if y.dtype.is_floating else tf.int32)


def parse_shape(text: str, flag: str) -> tuple:
    """A flag's "A,B,C" -> (A, B, C) positive integers; anything else is a UserError naming --flag."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise UserError(f"--{flag}={text!r}: expected positive integers separated by commas, e.g. 32,32,3")
    return shape


# Off: tf.data's autotuning of the engine's pipelines. It trains no faster here, and deleting an
# autotuned iterator can stall (engine/data/pipelines.py); benchmarks/input_pipelines.py measures
# the engine's training rate with it on and off in one run (docs/performance.md "Input from files").
AUTOTUNE_PIPELINES = False


def with_options(
    dataset: tf.data.Dataset, deterministic: bool = True, policy=tf.data.experimental.AutoShardPolicy.DATA
) -> tf.data.Dataset:
    """The engine's options for every pipeline it builds: deterministic order, the auto-shard
    policy, and no tf.data autotuning (see engine/data/pipelines.py: deleting an autotuned iterator
    could block the process's exit for up to a minute; AUTOTUNE_PIPELINES)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    options.deterministic = deterministic
    options.autotune.enabled = AUTOTUNE_PIPELINES
    return dataset.with_options(options)


@tf.autograph.experimental.do_not_convert  # plain Python over a trace; the augmentation itself is converted
def augmented_spec(augment, features: tf.TensorSpec, labels: tf.TensorSpec):
    """What the Task's `augment(features, label, position)` returns for one example of this spec: a
    structure (tuple, dict, ...) of tf.TensorSpec, found by tracing it once, nothing run. A
    structure the engine cannot batch (a shape that varies per example, a ragged or sparse tensor,
    a Python object, a string where the data held numbers) is a UserError naming the function and
    every shape it returned."""
    returned = []

    def probe(x, y, position):
        returned.append(augment(x, y, position))
        return tf.constant(0)  # what it returned is read from the trace, never run

    tf.function(probe).get_concrete_function(features, labels, tf.TensorSpec([], tf.int64))
    structure = returned[0]
    leaves = tf.nest.flatten(structure, expand_composites=False)
    inputs = (features.dtype, labels.dtype)
    problems = [_why_not_batched(leaf, inputs) for leaf in leaves]
    problems = [p for p in problems if p]
    if problems or not leaves:
        where = getattr(augment, "where", "Task.augment_example")
        shown = describe_structure(structure)
        why = problems[0] if problems else "nothing to train on"
        raise UserError(
            f"{where} returned {shown}, which the engine cannot batch: {why}; every example must give "
            "tensors of one fixed shape (crop or resize to a fixed size, pad, or keep the count fixed)"
        )
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), structure)


def _why_not_batched(leaf, input_dtypes) -> str | None:
    if isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
        return f"a {type(leaf).__name__} (its shape differs per example)"
    if not isinstance(leaf, tf.Tensor):
        return f"a Python {type(leaf).__name__} is not a tensor"
    if not leaf.shape.is_fully_defined():
        return f"shape {_shape(leaf.shape)} varies per example (None: not known before the example is seen)"
    numbers = leaf.dtype.is_floating or leaf.dtype.is_integer or leaf.dtype.is_bool
    if not numbers and leaf.dtype not in input_dtypes:
        return f"a {leaf.dtype.name} tensor where the data held numbers"
    return None


def _shape(shape) -> str:
    if shape.rank is None:
        return "(unknown rank)"
    return (
        "("
        + ", ".join("None" if d is None else str(d) for d in shape.as_list())
        + ("," if shape.rank == 1 else "")
        + ")"
    )


def describe_structure(structure) -> str:
    """One example's structure in one line, e.g. (float32 (2, 28, 28, 1), int32 ()); dicts by key."""
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{key!r}: {describe_structure(value)}" for key, value in structure.items()) + "}"
    if isinstance(structure, (tuple, list)):
        inner = ", ".join(describe_structure(value) for value in structure)
        return f"({inner})" if isinstance(structure, tuple) else f"[{inner}]"
    kind = (
        "ragged "
        if isinstance(structure, tf.RaggedTensor)
        else "sparse "
        if isinstance(structure, tf.SparseTensor)
        else ""
    )
    if isinstance(structure, (tf.Tensor, tf.TensorSpec, tf.RaggedTensor, tf.SparseTensor)):
        return f"{kind}{structure.dtype.name} {_shape(structure.shape)}"
    return f"a Python {type(structure).__name__}"


def check_example_pair(where: str, element) -> None:
    """A parser's or a Task's own pipeline's example must be (features, label), one tensor each,
    because evaluation, the model build and the export read them; a UserError naming `where` and
    what it gave otherwise (a structure for training alone belongs in augment_example)."""
    pair = isinstance(element, tuple) and len(element) == 2
    if not (pair and all(isinstance(part, tf.TensorSpec) for part in element)):
        raise UserError(
            f"{where} gives {describe_structure(element)}; expected (features, label), one tensor each "
            "(evaluation, the model and the export take that pair): return a structure for training "
            "from augment_example instead (docs/data.md#augmentation)"
        )


def augment_each(augment, x, y, positions):
    """A batch (x, y) with the Task's `augment(x, y, position)` applied to each example; `positions`
    are the examples' stream positions (int64), their seeds. The result is stacked in whatever
    structure and shapes `augment` returns for one example (augmented_spec)."""
    return tf.map_fn(
        lambda example: augment(*example),
        (x, y, positions),
        fn_output_signature=augmented_spec(
            augment, tf.TensorSpec(x.shape[1:], x.dtype), tf.TensorSpec(y.shape[1:], y.dtype)
        ),
    )
