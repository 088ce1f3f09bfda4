"""The step's context: what a Task's train_step may call while the engine traces it, in replica
context, and where the engine finds what the step handed over.

  hand_over      Task.apply_gradients: records one optimizer's gradients (the engine's update,
                 engine/update.py, sums and applies them after the step)
  note_scaled    Task.scale_loss was called (mixed_float16 needs it)
  all_reduce     Task.all_reduce: SUM over every replica and worker
  all_gather     Task.all_gather: every replica's and worker's values, concatenated in replica order
  example_seeds  Task.example_seeds: per-example stateless seeds that do not depend on the layout
  collect        Task.collect (eval_step only): per-example tensors for the host's Task.eval_summary

The engine's compiled loop (engine/loop.py) enters `tracing(...)` around each trace of the Task's
train step and reads the yielded `Handed` afterwards; the eval loop enters `collecting()` around
each trace of eval_step and reads the yielded {name: tensor}. The record is thread-local because
MirroredStrategy traces each replica's step on its own thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import tensorflow as tf

from engine.errors import UserError

_local = threading.local()


@dataclasses.dataclass
class Hand:
    """One Task.apply_gradients call: an optimizer's gradients (None = the engine's optimizer)."""

    optimizer: object
    gradients: list
    variables: list
    when: tf.Tensor | None = None


@dataclasses.dataclass
class Handed:
    """What one trace of a train_step handed to the engine on this replica."""

    hands: list = dataclasses.field(default_factory=list)
    scaled: bool = False  # the step called Task.scale_loss

    @property
    def gradients(self) -> list:
        """The handed-over gradients that are not None, all optimizers in hand-over order."""
        return [g for hand in self.hands for g in hand.gradients if g is not None]

    def whens(self) -> list:
        """The `when` of each hand that has one, as scalar bools (hand-over order)."""
        return [tf.reshape(tf.cast(hand.when, tf.bool), []) for hand in self.hands if hand.when is not None]


class CollectiveInLoop(Exception):
    """A step's collective was traced inside the micro-batch while_loop (where MirroredStrategy's
    merge_call cannot run): the engine retraces with the micro-batches unrolled."""


@dataclasses.dataclass
class _Trace:
    """Where the step is being traced: inside the micro-batch while_loop, inside the XLA step, and
    the index of this micro-batch's first example in the GLOBAL batch."""

    in_loop: bool = False
    jit_strategy: str | None = None  # --strategy when the step is XLA-compiled
    example_offset: object = 0
    micro_batch: object = 0  # which of the --grad_accum_steps micro-batches (int, or int32 in the loop)


@contextlib.contextmanager
def tracing(*, in_loop=False, jit_strategy=None, example_offset=0, micro_batch=0):
    """Around one trace of a Task's step: collects what it hands over; yields the Handed."""
    handed, previous = Handed(), (getattr(_local, "handed", None), getattr(_local, "trace", None))
    _local.handed, _local.trace = handed, _Trace(in_loop, jit_strategy, example_offset, micro_batch)
    try:
        yield handed
    finally:
        _local.handed, _local.trace = previous


def micro_batch():
    """Task.micro_batch: the index of the micro-batch train_step is on (0 without accumulation)."""
    trace = getattr(_local, "trace", None)
    if trace is None:
        raise UserError("self.micro_batch is only valid inside the engine's train_step")
    return trace.micro_batch


@contextlib.contextmanager
def scoped(local: threading.local, name: str, value):
    """`local.<name>` is `value` inside the block (yielded), what it was before after it."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield value
    finally:
        setattr(local, name, previous)


def after_update():
    """Around the Task's after_update hook: it runs under a tf.cond (only when the update was
    applied), where no collective can run."""
    return scoped(_local, "in_after_update", True)


def _handed(what) -> Handed:
    handed = getattr(_local, "handed", None)
    if handed is None:
        raise UserError(f"{what} is only valid inside the engine's train_step")
    return handed


def hand_over(gradients, variables, optimizer=None, when=None) -> None:
    """Task.apply_gradients: records this replica's gradients for the engine's update."""
    handed = _handed("Task.apply_gradients")
    if any(hand.optimizer is optimizer for hand in handed.hands):
        raise UserError(
            "train_step called self.apply_gradients twice for the same optimizer; add the "
            "losses (or the gradients) and hand them over once per optimizer and step"
        )
    gradients, variables = list(gradients), list(variables)
    if len(gradients) != len(variables):
        raise UserError(f"self.apply_gradients got {len(gradients)} gradients for {len(variables)} variables")
    handed.hands.append(Hand(optimizer, gradients, variables, when))


def note_scaled() -> None:
    handed = getattr(_local, "handed", None)
    if handed is not None:
        handed.scaled = True


def _collective(what):
    """The replica context, where the traced step may run a collective now: refused in one line
    in an XLA-compiled step under a merge_call strategy; CollectiveInLoop in the micro-batch loop."""
    if getattr(_local, "in_after_update", False):
        raise UserError(
            f"after_update calls {what} (a collective); it runs only when the update was applied, "
            "where no collective can run: gather in train_step and keep what after_update needs in a variable"
        )
    trace = getattr(_local, "trace", None)
    if trace is not None and trace.jit_strategy:
        raise UserError(
            f"train_step calls {what} (a collective), which --strategy={trace.jit_strategy} "
            "cannot run inside the XLA-compiled step; drop --jit_compile"
        )
    if trace is not None and trace.in_loop:
        raise CollectiveInLoop(what)
    return tf.distribute.get_replica_context()


def all_reduce(value, what="self.all_reduce"):
    """SUM over every replica and worker (replica context, inside train_step)."""
    return _collective(what).all_reduce(tf.distribute.ReduceOp.SUM, value)


def all_gather(value, axis=0, what="self.all_gather"):
    """Every replica's and worker's `value` (a tensor or a nest of them) concatenated along `axis`
    in replica order, the same on every replica: one gather (TensorFlow's ReplicaContext.all_gather),
    whose gradient is the upstream gradient summed over replicas, sliced to this replica's rows."""
    for tensor in tf.nest.flatten(value):
        if tf.convert_to_tensor(tensor).shape.rank == 0:
            raise UserError(f"{what} needs tensors of rank >= 1 (got a scalar); gather tf.reshape(x, [1])")
    return _collective(what).all_gather(value, axis)


# TensorFlow's refusal of a merge_call where the step's graph cannot hold one.
_RAW_MERGE_CALL = "`merge_call` called while defining a new graph"


@contextlib.contextmanager
def raw_collectives_refused(accum_steps=1, jit_compile=False):
    """Around tracing the step: a raw replica-context collective (merge_call, or
    get_replica_context().all_reduce/all_gather) where TensorFlow cannot run one becomes one line."""
    try:
        yield
    except RuntimeError as err:
        if _RAW_MERGE_CALL not in str(err):
            raise
        where = " and ".join(
            place
            for place, present in (
                (f"the micro-batch loop of --grad_accum_steps={accum_steps}", accum_steps > 1),
                ("the XLA-compiled step (--jit_compile)", jit_compile),
            )
            if present
        )
        raise UserError(
            "the step calls a raw replica-context collective (merge_call, or get_replica_context()"
            f".all_reduce/all_gather), which TensorFlow cannot run inside {where or 'a nested tf.function'}; "
            "use self.all_reduce / self.all_gather, which the engine runs there (or refuses in one line)"
        ) from None


def example_seeds(key, n) -> tf.Tensor:
    """[n, 2] int64 stateless seeds for the n examples of this replica's (micro-)batch: `key` ([2]
    int32, replica-independent) with, in train_step, the example's index in the GLOBAL batch folded
    in, and in eval_step a fingerprint of the example itself (`evaluating`)."""
    trace = getattr(_local, "trace", None)
    key = tf.cast(key, tf.int32)
    if trace is None:
        batch = getattr(_local, "eval_batch", None)
        if batch is None:
            raise UserError("self.example_seeds is only valid inside the engine's train_step and eval_step")
        return tf.cast(tf.bitwise.bitwise_xor(key[None, :], _fingerprints(batch, n)), tf.int64)
    index = tf.cast(trace.example_offset, tf.int32) + tf.range(n, dtype=tf.int32)
    seeds = tf.stack([tf.fill([n], key[0]), tf.bitwise.bitwise_xor(key[1], index)], axis=1)
    return tf.cast(seeds, tf.int64)


def _fingerprints(batch, n) -> tf.Tensor:
    """[n, 2] int32: each example's 64-bit fingerprint over every tensor of the batch (its
    features and label). An evaluation example has no position that holds under every layout
    (replica and worker splits, streamed shards, the batch size), but its content does."""
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(batch)]
    rows = [tf.fingerprint(tf.reshape(t, [tf.shape(t)[0], -1])) for t in leaves if t.shape.rank]
    fingerprint = tf.fingerprint(tf.concat(rows, axis=1)) if len(rows) > 1 else rows[0]  # [n, 8] uint8
    with tf.control_dependencies(
        [
            tf.debugging.assert_equal(
                tf.shape(fingerprint)[0],
                tf.cast(n, tf.int32),
                message="self.example_seeds(n) in eval_step: n must be this replica's batch size",
            )
        ]
    ):
        return tf.bitcast(tf.reshape(fingerprint, [-1, 2, 4]), tf.int32)


def evaluating(batch):
    """Around one call of a Task's eval_step on this replica's `batch`: example_seeds keys each
    example by a fingerprint of its content, so a sampled evaluation is the same on any layout."""
    return scoped(_local, "eval_batch", batch)


def collecting():
    """Around one trace of a Task's eval_step: yields the {name: tensor} its self.collect calls gave."""
    return scoped(_local, "collected", {})


def collect(name, tensor) -> None:
    """Task.collect: records this replica's per-example `tensor` (leading axis: the examples of
    its batch) under `name`, for the host's Task.eval_summary."""
    collected = getattr(_local, "collected", None)
    if collected is None:
        raise UserError(f"self.collect({name!r}, ...) is only valid inside the engine's eval_step")
    if not isinstance(name, str) or not name:
        raise UserError(f"self.collect needs a name (a non-empty str), got {name!r}")
    if name in collected:
        raise UserError(f"eval_step calls self.collect({name!r}, ...) twice; collect each name once per step")
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise UserError(
            f"self.collect({name!r}, ...) got a scalar; it needs one row per example of the batch "
            "(leading axis: the examples), e.g. the batch's logits or labels"
        )
    collected[name] = tensor
