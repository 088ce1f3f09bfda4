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

All updates run after the step returns, so every optimizer sees the pre-step weights. The step
hands its gradients over through engine/step_context.py; the engine (engine/loop.py) sums the
records of the micro-batches and calls `Updater.apply`.
"""

from __future__ import annotations

import dataclasses
import threading

import tensorflow as tf

from engine import compat, step_context
from engine.errors import UserError

INITIAL_LOSS_SCALE = 2.0**15
GROWTH_INTERVAL = 2000  # good steps before the loss scale doubles
MIN_LOSS_SCALE = 1.0  # an overflow at this scale is a real non-finite gradient
GRAD_NORM = "grad_norm"  # the default optimizer's summary; others are grad_norm/<Task attribute>

_local = threading.local()


def _already_reduced():
    return step_context.scoped(_local, "reduced", True)


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
        step_context.note_scaled()
        if not self.loss_scaling:
            return loss
        return loss * tf.cast(self.loss_scale, loss.dtype)

    def groups(self, handed: step_context.Handed, whens) -> list:
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
