"""The optimizer update, owned by the engine: what happens to a replica's gradients after the
Task's train_step hands them over with `Task.apply_gradients` (once per optimizer).

In replica context, once per step (after all micro-batches of a global batch):

  1. ONE all-reduce (SUM) of the gradients of EVERY optimizer over every replica and worker
     (invariant 4: Keras' own all-reduce inside `apply` is switched off for this call, never doubled);
  2. unscale (dynamic loss scaling, --precision=mixed_float16; one loss scale for the step);
  3. ONE finite check over all the SUMMED gradients, read off each optimizer's global norm (computed
     anyway for its summary and clipping: an Inf/NaN anywhere makes its norm non-finite; so does a
     gradient element above ~1e19, whose square overflows float32): an Inf/NaN on any replica makes
     the sum non-finite on every replica, so all replicas and workers decide alike with no extra
     collective (invariant 5), unlike Keras' LossScaleOptimizer, which checks the local gradients only;
  4. global-norm clipping (--clip_norm) of each optimizer's summed gradients, so the norm is the true one;
  5. guarded (--on_nonfinite=skip or rollback, or loss scaling): every optimizer's Keras update
     (weight decay included) inside a cond taken in cross-replica context: a non-finite step leaves
     weights, every optimizer's state (moments, iterations) and the models' non-trainable state
     (batch-norm statistics, put back from a copy taken before the step) untouched; the loss scale
     halves on overflow and doubles after GROWTH_INTERVAL good steps.
     Unguarded (--on_nonfinite=stop without loss scaling): the updates run in replica context beside
     the check, without waiting for it; a bad step's update happens, and the loop stops at it
     (engine/loop.py) and the run ends without saving (nothing after the last checkpoint is kept).
     An optimizer handed over with `when` steps only where `when` is True (a cond in cross-replica
     context in either mode; its gradients are all-reduced every step: no collective inside a cond).

All updates run after the step returns, so every optimizer sees the pre-step weights.
`Task.apply_gradients` only records the gradients (thread-local: MirroredStrategy traces each
replica on its own thread); the engine (engine/loop.py) sums the records of the micro-batches and
calls `Updater.apply`. `all_reduce` / `example_seeds` are the step's collectives and per-example
seeds, which need to know where the step is being traced (`tracing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import tensorflow as tf

from engine import compat
from engine.errors import UserError

INITIAL_LOSS_SCALE = 2.0**15
GROWTH_INTERVAL = 2000  # good steps before the loss scale doubles
MIN_LOSS_SCALE = 1.0  # an overflow at this scale is a real non-finite gradient
GRAD_NORM = "grad_norm"  # the default optimizer's summary; others are grad_norm/<Task attribute>

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


@contextlib.contextmanager
def collecting(*, in_loop=False, jit_strategy=None, example_offset=0):
    """Collects what Task.apply_gradients / Task.scale_loss are given while tracing; yields a Handed."""
    handed, previous = Handed(), (getattr(_local, "handed", None), getattr(_local, "trace", None))
    _local.handed, _local.trace = handed, _Trace(in_loop, jit_strategy, example_offset)
    try:
        yield handed
    finally:
        _local.handed, _local.trace = previous


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


def all_reduce(value, what="self.all_reduce"):
    """SUM over every replica and worker (replica context, inside train_step)."""
    trace = getattr(_local, "trace", None)
    if trace is not None and trace.jit_strategy:
        raise UserError(
            f"train_step calls {what} (a collective), which --strategy={trace.jit_strategy} "
            "cannot run inside the XLA-compiled step; drop --jit_compile"
        )
    if trace is not None and trace.in_loop:
        raise CollectiveInLoop(what)
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def example_seeds(key, n) -> tf.Tensor:
    """[n, 2] int64 stateless seeds for the n examples of this replica's (micro-)batch: `key` ([2]
    int32, replica-independent) with the example's index in the GLOBAL batch folded in."""
    trace = getattr(_local, "trace", None)
    if trace is None:
        raise UserError("self.example_seeds is only valid inside the engine's train_step")
    index = tf.cast(trace.example_offset, tf.int32) + tf.range(n, dtype=tf.int32)
    key = tf.cast(key, tf.int32)
    seeds = tf.stack([tf.fill([n], key[0]), tf.bitwise.bitwise_xor(key[1], index)], axis=1)
    return tf.cast(seeds, tf.int64)


@contextlib.contextmanager
def _already_reduced():
    previous = getattr(_local, "reduced", False)
    _local.reduced = True
    try:
        yield
    finally:
        _local.reduced = previous


def _gradients_already_reduced() -> bool:
    """True while the engine applies gradients it summed itself (Keras' all-reduce is then skipped)."""
    return getattr(_local, "reduced", False)


@dataclasses.dataclass
class Group:
    """One optimizer's share of a step: its summed gradients' variables and when it steps."""

    optimizer: object
    variables: list
    when: tf.Tensor | None  # None: steps whenever the step is good


@dataclasses.dataclass
class Outcome:
    """One step's update, the same value on every replica."""

    applied: tf.Tensor  # bool: the optimizers stepped
    bad: tf.Tensor  # bool: non-finite gradients that loss scaling does not explain
    summaries: dict  # {summary name: float32 scalar}, e.g. grad_norm per optimizer (before clipping)
    gradients: list  # the default optimizer's summed, unscaled gradients


class Updater:
    """Build inside strategy.scope() (it may own loss-scale variables). `optimizers`: {Task
    attribute name: optimizer} of the Task's other optimizers (built), each with its summary."""

    def __init__(
        self, optimizer, *, loss_scaling: bool, clip_norm: float = 0.0, optimizers=None, ema=None, guarded: bool = True
    ):
        self.optimizer = optimizer
        # guarded: a bad step's update is skipped (it waits for the finite check); loss scaling must
        # skip overflowed steps, so it always is.
        self.guarded = guarded or loss_scaling
        self.ema = ema  # engine/ema.py WeightAverage (--ema_decay): moved after each applied update
        self.clip_norm = clip_norm
        self.loss_scaling = loss_scaling
        self.names = {id(optimizer): GRAD_NORM}
        self.names.update(
            {id(other): f"{GRAD_NORM}/{name}" for name, other in (optimizers or {}).items() if other is not optimizer}
        )
        for other in [optimizer, *(optimizers or {}).values()]:
            compat.skip_keras_all_reduce(other, _gradients_already_reduced)
        self.loss_scale = self.good_steps = None
        if loss_scaling:
            only_first = tf.VariableAggregation.ONLY_FIRST_REPLICA
            self.loss_scale = tf.Variable(
                INITIAL_LOSS_SCALE, dtype=tf.float32, trainable=False, name="loss_scale", aggregation=only_first
            )
            self.good_steps = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="loss_scale_good_steps", aggregation=only_first
            )

    @property
    def summary_names(self) -> tuple:
        """What Outcome.summaries may hold: grad_norm of each optimizer."""
        return tuple(self.names.values())

    def checkpoint_items(self) -> dict:
        """Variables a resumed run needs (the loss scale and its counter, the weight averages), for
        tf.train.Checkpoint."""
        items = self.ema.checkpoint_items() if self.ema is not None else {}
        if self.loss_scaling:
            items.update(loss_scale=self.loss_scale, loss_scale_good_steps=self.good_steps)
        return items

    def scale(self, loss):
        """Task.scale_loss: the loss times the current loss scale (the loss itself without scaling)."""
        note_scaled()
        if not self.loss_scaling:
            return loss
        return loss * tf.cast(self.loss_scale, loss.dtype)

    def groups(self, handed: Handed, whens) -> list:
        """The Handed's hands as Groups (the default optimizer resolved, variables of None
        gradients dropped, `whens` as Handed.whens() gave them); an optimizer that is not the
        Task's is a UserError."""
        groups, whens = [], iter(whens)
        for hand in handed.hands:
            when = None if hand.when is None else next(whens)
            optimizer = self.optimizer if hand.optimizer is None else hand.optimizer
            if id(optimizer) not in self.names:
                raise UserError(
                    "self.apply_gradients(optimizer=...) got an optimizer the Task does not hold: create it in "
                    "build_extras(), build it there (optimizer.build(variables)) and keep it as an attribute, "
                    "so the engine builds, checks and checkpoints it"
                )
            groups.append(Group(optimizer, [v for g, v in zip(hand.gradients, hand.variables) if g is not None], when))
        return groups

    def apply(self, groups, gradients, kept_state) -> Outcome:
        """Replica context: sum over replicas, unscale, check, clip, apply (see the module doc).

        groups: one Group per optimizer handed over; gradients: this replica's, all groups' in
        order, one per variable of each group.
        kept_state: (variables, their values before the step), put back when the update is skipped:
        the batch-norm moving statistics, which the forward pass already moved (maybe to NaN)."""
        context = tf.distribute.get_replica_context()
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(g, tf.float32) for g in gradients])
        if self.loss_scaling:
            scale = tf.identity(self.loss_scale)  # read before the update below changes it
            summed = [g * (1.0 / scale) for g in summed]
        summaries, clipped, per_group, start = {}, [], [], 0
        for group in groups:
            own = summed[start : start + len(group.variables)]
            start += len(group.variables)
            per_group.append(own)
            norm = tf.linalg.global_norm(own)
            summaries[self.names[id(group.optimizer)]] = norm
            if self.clip_norm:
                factor = self.clip_norm / tf.maximum(norm, self.clip_norm)
                own = [g * factor for g in own]
            clipped.append([tf.cast(g, v.dtype) for g, v in zip(own, group.variables)])
        # The norms, one per optimizer, are >= 0: their sum is finite exactly when each is.
        finite = tf.math.is_finite(tf.add_n(list(summaries.values())))
        whens = [group.when for group in groups if group.when is not None]
        if not self.guarded and not whens:  # beside the check: nothing waits for it
            with _already_reduced():
                for group, grads in zip(groups, clipped):
                    group.optimizer.apply(grads, group.variables)
            if self.ema is not None:
                context.merge_call(self.ema.update)
            applied = tf.constant(True)
        else:
            applied = context.merge_call(
                self._apply_or_skip,
                args=(clipped, whens, finite if self.guarded else tf.constant(True), list(kept_state[1])),
                kwargs={
                    "optimizers": [group.optimizer for group in groups],
                    "variables": [group.variables for group in groups],
                    "conditional": [group.when is not None for group in groups],
                    "kept": list(kept_state[0]),
                },
            )
        bad = tf.logical_not(finite)
        if self.loss_scaling:  # an overflow is only bad once the scale cannot fall further
            bad = tf.logical_and(bad, tf.less_equal(scale, MIN_LOSS_SCALE))
        default = [own for group, own in zip(groups, per_group) if group.optimizer is self.optimizer]
        return Outcome(applied=applied, bad=bad, summaries=summaries, gradients=default[0] if default else [])

    def _apply_or_skip(self, strategy, gradients, whens, finite, before, *, optimizers, variables, conditional, kept):
        """Cross-replica context: a cond here may call the optimizers (whose updates need a
        merge_call, impossible inside a cond in replica context)."""

        def first(value):  # computed from summed values or the step counter: the same on every replica
            return strategy.experimental_local_results(value)[0]

        def stepper(optimizer, grads, variables):
            def update(grads):
                with _already_reduced():
                    optimizer.apply(list(grads), variables)

            def step():
                strategy.extended.call_for_each_replica(update, args=(grads,))
                return tf.constant(True)

            return step

        def good():
            conditions = iter(whens)
            for optimizer, grads, own, has_when in zip(optimizers, gradients, variables, conditional):
                step = stepper(optimizer, grads, own)
                if not has_when:
                    step()
                else:
                    tf.cond(first(next(conditions)), step, lambda: tf.constant(False))
            if self.ema is not None:
                self.ema.update(strategy)
            if self.loss_scaling:
                grow = self.good_steps + 1 >= GROWTH_INTERVAL
                self.loss_scale.assign(tf.where(grow, self.loss_scale * 2.0, self.loss_scale))
                self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1))
            return tf.constant(True)

        def overflow():
            for variable, value in zip(kept, before):
                strategy.extended.update(variable, _assign, args=(value,), group=False)
            if self.loss_scaling:
                self.loss_scale.assign(tf.maximum(self.loss_scale * 0.5, MIN_LOSS_SCALE))
                self.good_steps.assign(0)
            return tf.constant(False)

        return tf.cond(first(finite), good, overflow)


def _assign(variable, value):
    return variable.assign(value)


def snapshot(variables) -> tuple:
    """(variables, their current values), for Updater.apply's kept_state (replica context)."""
    variables = [getattr(v, "value", v) for v in variables]
    return variables, [tf.identity(v) for v in variables]
