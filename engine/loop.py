"""The compiled inner loops: many `strategy.run` steps per tf.function call.

A training loop's body reads in one screen (`make_train_loop`): next batch -> run the replica step
-> reduce its metrics -> judge the step -> count it. The pieces:

  _TrainStep   one replica's step: the Task's train_step on each micro-batch (engine/step_context.py
               collects what it hands over), then engine/update.py's update (one all-reduce)
  _Feed        where each step's batch comes from (a distributed iterator, or resident arrays
               gathered on the replica) and the stall watch's batch counter
  step_verdict what a step's reduced outcome means for the loop (a pure function)

Each step's metrics {name: (total, count)} are stacked into one vector on each replica, reduced
across replicas with ONE strategy.reduce(SUM) per step and summed over the steps of the loop. The
step count is a tensor, so a loop of any length reuses one trace (no retracing between the loops
of a run).

A step is bad when a reduced metric total is not finite (a NaN/Inf loss on any replica) or when
the summed gradients are (and loss scaling does not explain it). Both are the same value on every
replica and worker, so every replica takes the same branch, and the decision stays on the device
(no host sync per step): with stop, the loop ends before counting the bad step (its update ran
beside the check, engine/update.py; the run then ends without saving); with skip (and rollback),
the step counts (its batch is consumed) but its metrics do not, and its update never happens.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import typing
import warnings

import tensorflow as tf

from engine import compat, refused_combinations, step_context, update, user_code
from engine.errors import UserError
from engine.task import Task

# Iterating a distributed dataset inside tf.function makes tf.data warn about options it cannot
# see at trace time; the engine sets its options before distributing, so the warning is noise.
warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")


class _EagerOverheadNoted(logging.Filter):
    """strategy.run called eagerly (--run_eagerly) logs "Using MirroredStrategy eagerly has significant
    overhead" on each of its first calls; the banner already says the run is eager and slow."""

    def filter(self, record):
        return "eagerly has significant overhead" not in str(record.msg)


tf.get_logger().addFilter(_EagerOverheadNoted())


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """How train() compiles its training loop (from the run's flags: `from_config`)."""

    accum_steps: int = 1  # --grad_accum_steps: micro-batches per replica and step
    jit_compile: bool = False  # --jit_compile: the replica step compiled with XLA
    skip_nonfinite: bool = False  # a bad step counts (skip, rollback) instead of ending the loop (stop)
    loss_upper_bound: float = 0.0  # > 0: a step whose reduced "loss" exceeds it is bad too (a spike)
    update_summaries: bool = False  # the updater's summaries (grad_norm per optimizer) in the totals
    gradients: bool = False  # keep the last step's summed gradients (histograms)
    # Every model the Task trains (a skipped step puts their non-trainable state back); (): task.model.
    models: tuple = ()
    strategy_name: str = ""  # --strategy (a collective in an XLA-compiled step is refused under merge_call strategies)
    run_eagerly: bool = False  # --run_eagerly: the loop runs as Python, no tf.function (debugging)

    @classmethod
    def from_config(cls, config, models=()) -> LoopOptions:
        return cls(
            accum_steps=config.grad_accum_steps,
            jit_compile=config.jit_compile,
            skip_nonfinite=config.on_nonfinite == "skip",
            loss_upper_bound=config.loss_upper_bound,
            update_summaries=config.summaries == "full",
            gradients=config.histogram_every > 0,
            models=tuple(models),
            strategy_name=config.strategy,
            run_eagerly=config.run_eagerly,
        )


def released_after_tracing(function):
    """`function` (a tf.function) with the custom gradients its tracing registered dropped after
    each call.

    An all-reduce in replica context (the engine's gradient sum, Task.all_reduce, synchronised batch
    norm) is a `tf.custom_gradient`, which registers its gradient in TensorFlow's global registry
    with tensors of the graph being traced in its closure: every loop ever traced stayed in memory
    with its whole graph (TF issue 97697), so a sweep of runs in one process grew without bound. A
    registration serves only while its graph's gradients are built, i.e. during the trace: once the
    call returns no one needs it. A call that traces nothing registers nothing and costs one dict
    lookup. It drops every registration made during the call, so a trace running at the same time
    in another thread of the process (the engine never does; its replica threads trace inside this
    call) could lose its own."""

    def call(*args):
        registry = compat.custom_gradient_registry()
        last = next(reversed(registry), None) if registry else None
        try:
            return function(*args)
        finally:
            if registry and next(reversed(registry)) != last:  # insertion order: this call's are at the end
                for name in list(itertools.takewhile(lambda name: name != last, reversed(registry))):
                    if str(name).startswith("CustomGradient-"):
                        del registry[name]

    call.experimental_get_tracing_count = function.experimental_get_tracing_count
    return call


def compiled_for_one_run(loop):
    """tf.function(loop) as each train() builds its loops: released_after_tracing, and counted by
    TensorFlow's retracing detector on its own. The detector keys a tf.function by its Python
    code, so the loops that every train() of a process builds afresh (a sweep, a notebook, the test
    suite) counted as one function retraced on each call, and from the fifth run on TensorFlow
    warned "5 out of the last 5 calls to eval_loop triggered tf.function retracing". A partial has
    no code of its own: the detector keys it by the object, one per run (tests/test_eval.py)."""
    own = functools.partial(loop)
    own.__name__ = loop.__name__  # the traced graphs keep their names (no __wrapped__: that is unwrapped to the code)
    return released_after_tracing(tf.function(own))


def compiled_unless_eager(loop, run_eagerly: bool):
    """compiled_for_one_run(loop), or with --run_eagerly the Python function itself: each step then
    runs op by op (strategy.run runs MirroredStrategy's replicas in threads), so print, pdb and
    .numpy() work in the Task's steps. It traces nothing: its tracing count stays 0."""
    if not run_eagerly:
        return compiled_for_one_run(loop)
    loop.experimental_get_tracing_count = lambda: 0
    return loop


def _check_names(outputs, names, step_name):
    if not isinstance(outputs, dict) or tuple(sorted(outputs)) != tuple(sorted(names)):
        got = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise UserError(
            f"{step_name} returned {got}; it must return a dict with exactly the names "
            f"{sorted(names)} (declared in the Task), each a (total, count) pair"
        )


def _float32_outputs(step_fn, names, step_name):
    """Wraps a Task step (replica context): checks its names, casts its values to float32."""

    def replica_step(batch):
        outputs = step_fn(batch)
        _check_names(outputs, names, step_name)
        return {name: tuple(_scalar(value, name, step_name) for value in outputs[name]) for name in names}

    return replica_step


def _scalar(value, name, step_name):
    """One float32 scalar of a step's (total, count); a vector is refused in one line, naming it."""
    value = tf.cast(value, tf.float32)
    if value.shape.rank != 0:
        raise UserError(
            f"{step_name} returned a total or count of shape {tuple(value.shape)} for {name!r}; a "
            "metric's total and count are scalars: return one name per element, or self.collect "
            "the per-example values in eval_step and compute the metric in Task.eval_summary"
        )
    return value


def _add(totals, more):
    return {name: (totals[name][0] + more[name][0], totals[name][1] + more[name][1]) for name in totals}


class StepOutcome(typing.NamedTuple):
    """One replica step's result, as strategy.run returns it (per replica)."""

    stacked: tf.Tensor  # the metrics' (and the update's summaries') totals and counts, one vector
    bad: tf.Tensor  # bool: non-finite summed gradients (the same on every replica)
    applied: tf.Tensor  # bool: the optimizers stepped
    gradients: list  # the summed gradients, when the loop keeps them (histograms); else []


class _TrainStep:
    """One replica's training step: micro-batches, then the engine's update."""

    def __init__(self, task, names, options: LoopOptions):
        self.task, self.accum_steps = task, options.accum_steps
        self.update_summaries, self.keep_gradients = options.update_summaries, options.gradients
        # The stacked vector a step returns: these names' (total, count), in this order.
        self.names = tuple(names) + (task.updater.summary_names if options.update_summaries else ())
        self._step = _float32_outputs(task.train_step, names, "train_step")
        # What the last trace of the Task's step handed over (Python, trace time). Shared by the
        # replica threads on purpose: with jit_compile one trace serves every replica; the handed
        # structure (which gradients exist, their variables) is the same on all of them.
        self._handed = None
        merge_calls = options.strategy_name in refused_combinations.MERGE_CALL_STRATEGIES
        self.jit_strategy = options.strategy_name if options.jit_compile and merge_calls else None
        self._compute = tf.function(self._compute_fn, jit_compile=True) if options.jit_compile else self._compute_fn
        # The state a skipped update puts back: every trained model's non-trainable variables.
        self.models = list(options.models) or [task.model]
        # A layer that all-reduces inside its call (synchronised batch norm) needs a merge_call,
        # which TensorFlow refuses inside a while_loop's body: such models run their micro-batches
        # unrolled in Python, each normalised by the statistics of that micro-batch on every replica.
        # So do steps that call Task.all_reduce/all_gather (found when the loop body is traced: CollectiveInLoop).
        # Run eagerly, a collective runs anywhere; the micro-batches are unrolled all the same (a
        # while_loop would mark its body in_loop, which refuses collectives).
        self.after_update = type(task).after_update is not Task.after_update  # overridden: run it
        self.unrolled = options.run_eagerly or any(
            refused_combinations.cross_replica_layers(model) for model in self.models
        )

    def _compute_fn(self, batch, example_offset, in_loop=False, micro_batch=0):
        """The Task's step on one micro-batch -> (metrics, gradients handed over or [], whens)."""
        with step_context.tracing(
            in_loop=in_loop, jit_strategy=self.jit_strategy, example_offset=example_offset, micro_batch=micro_batch
        ) as handed:
            outputs = self._step(batch)
        self._handed = handed
        return outputs, handed.gradients, handed.whens()

    def _micro_batches(self, batch, offset):
        """Sums metrics and gradients over the micro-batches of this replica's batch."""
        k = self.accum_steps
        split = tf.nest.map_structure(
            lambda t: tf.reshape(t, tf.concat([[k, tf.shape(t)[0] // k], tf.shape(t)[1:]], 0)), batch
        )
        size = tf.shape(tf.nest.flatten(batch)[0])[0] // k

        def add_micro_batch(i, outputs, gradients, whens, in_loop=False):
            micro_batch = tf.nest.map_structure(lambda t: t[i], split)
            more, grads, whens = self._compute(micro_batch, offset + i * size, in_loop, i)
            return _add(outputs, more), [a + b for a, b in zip(gradients, grads)], whens

        first = self._compute(tf.nest.map_structure(lambda t: t[0], split), offset)
        if self.unrolled:  # K is static: one copy of the step per micro-batch, no while_loop
            for i in range(1, k):
                first = add_micro_batch(i, *first)
            return first
        _, *result = tf.while_loop(
            lambda i, *_: i < k,
            lambda i, *acc: (i + 1, *add_micro_batch(i, *acc, in_loop=True)),
            (tf.constant(1), *first),
        )
        return result

    def _apply(self, gradients, whens, kept_state):
        """The engine's update of what the step handed over -> update.Outcome, or None when the
        Task updated by itself (or not at all)."""
        handed, updater = self._handed, self.task.updater
        if not handed.hands:
            return None
        if updater.loss_scaling and not handed.scaled:
            raise UserError(
                "--precision=mixed_float16 scales the loss: train_step must take the "
                "gradients of self.scale_loss(loss), not of the loss itself"
            )
        return updater.apply(updater.groups(handed, whens), gradients, kept_state)

    def _after_update(self, applied):
        """Task.after_update, once per optimizer update, only where the update was applied (the
        same on every replica: it follows from the summed gradients)."""

        def hook():
            with step_context.after_update():
                self.task.after_update()
            return tf.constant(True)

        tf.cond(applied, hook, lambda: tf.constant(False))

    def _with_update_summaries(self, outputs, outcome):
        done = outcome.summaries if outcome is not None else {}
        missing = (tf.constant(0.0), tf.constant(0.0))
        summaries = {
            name: (done[name], tf.constant(1.0)) if name in done else missing
            for name in self.task.updater.summary_names
        }
        return dict(outputs, **summaries)

    def __call__(self, batch) -> StepOutcome:
        # Read before the forward pass moves them: put back if a guarded update is skipped.
        guarded = self.task.updater.guarded
        kept_state = update.snapshot([v for m in self.models for v in m.non_trainable_variables] if guarded else [])
        # This replica's first example in the global batch (training batches are whole).
        size = tf.shape(tf.nest.flatten(batch)[0])[0]
        offset = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32) * size
        if self.accum_steps == 1:
            outputs, gradients, whens = self._compute(batch, offset)
        else:
            outputs, gradients, whens = self._micro_batches(batch, offset)
        outcome = self._apply(gradients, whens, kept_state)
        if self.after_update:
            self._after_update(tf.constant(True) if outcome is None else outcome.applied)
        if self.update_summaries:
            outputs = self._with_update_summaries(outputs, outcome)
        stacked = _stacked(outputs, self.names)
        if outcome is None:
            return StepOutcome(stacked, tf.constant(False), tf.constant(True), [])
        return StepOutcome(stacked, outcome.bad, outcome.applied, outcome.gradients if self.keep_gradients else [])


def _stacked(outputs, names) -> tf.Tensor:
    """{name: (total, count)} -> one float32 vector [total, count, total, count, ...] in `names`' order."""
    return tf.stack([value for name in names for value in outputs[name]])


def _unstacked(vector, names) -> dict:
    """The inverse of _stacked."""
    return {name: (vector[2 * i], vector[2 * i + 1]) for i, name in enumerate(names)}


def _reduce(strategy, stacked) -> tf.Tensor:
    """SUM over replicas of a replica step's stacked (total, count) vector: ONE strategy.reduce
    (one collective under multi-worker) per step, whatever the number of metrics."""
    return strategy.reduce(tf.distribute.ReduceOp.SUM, stacked, axis=None)


class Verdict(typing.NamedTuple):
    good: tf.Tensor  # bool: the step's metrics count
    counted: tf.Tensor  # int32 0/1: the step counts as a step (its batch is consumed)
    stop: tf.Tensor  # bool: the loop ends here


def step_verdict(update_bad, metric_totals, *, skip_nonfinite=False, loss=None, loss_upper_bound=0.0) -> Verdict:
    """What one step's reduced outcome means for the loop, the same on every replica.

    update_bad: the update found non-finite summed gradients; metric_totals: the step's reduced
    (total, count) vector of the Task's metrics (a NaN/Inf anywhere makes its sum non-finite);
    loss: the reduced (total, count) of "loss", judged against loss_upper_bound when that is > 0.
    skip_nonfinite: a bad step still counts (skip, rollback) instead of ending the loop (stop)."""
    good = tf.logical_and(tf.logical_not(update_bad), tf.math.is_finite(tf.reduce_sum(metric_totals)))
    if loss_upper_bound:
        good = tf.logical_and(good, loss[0] <= loss_upper_bound * loss[1])
    if skip_nonfinite:
        return Verdict(good, tf.constant(1, tf.int32), tf.constant(False))
    return Verdict(good, tf.cast(good, tf.int32), tf.logical_not(good))


class _Feed:
    """Where each step's batch comes from, and the stall watch's count of batches taken.

    An iterator may hand over a reference that each replica turns into its batch (input_mode=
    resident: indices, gathered on the replica's device). One replica on resident arrays gathers
    the next step's batch while this step runs (two independent chains the executor runs side by
    side), and gives the batch gathered for the step after the loop back, so the data position
    counts exactly the steps taken. Several replicas gather inside the step: carrying their
    batches as a loop variable was slower on logical CPU replicas."""

    def __init__(self, strategy, iterator, replica_step, fetched=None):
        self.strategy, self.iterator, self.fetched = strategy, iterator, fetched
        self.replica_batch = getattr(iterator, "replica_batch", None)
        self.pipelined = self.replica_batch is not None and strategy.num_replicas_in_sync == 1
        if self.replica_batch is not None and not self.pipelined:
            self.step = lambda reference: replica_step(self.replica_batch(reference))
        else:
            self.step = replica_step

    def _gathered(self):
        return self.strategy.run(self.replica_batch, args=(next(self.iterator),))

    def start(self):
        """The loop variable `next_batch` carries: the first gathered batch, or () (unused)."""
        return self._gathered() if self.pipelined else ()

    def next(self, following):
        """(this step's batch, the loop variable for the next step)."""
        if self.pipelined:
            batch, following = following, self._gathered()
        else:
            batch = next(self.iterator)
        if self.fetched is not None:  # once the batch arrived (iterator and counter share no resource)
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)[:1]):
                self.fetched.assign_add(1)
        return batch, following

    def finish(self) -> None:
        if self.pipelined:
            self.iterator.give_back()


def make_train_loop(strategy, task, global_step: tf.Variable, options: LoopOptions | None = None, *, fetched=None):
    """train_loop(iterator, num_steps) -> dict with
      totals: {name: (total, count)} summed over replicas and the good steps; with update_summaries
        also the updater's summaries (e.g. "grad_norm": mean global norm per step of the summed
        gradients before clipping, "grad_norm/<optimizer>" for each other optimizer of the Task);
      learning_rate: the Task's optimizer's learning rate after the loop's last step;
      steps: the steps run, each added to `global_step` as it ends, so the counter matches the weights;
      bad_steps: with skip_nonfinite, how many steps were bad (skipped); otherwise 1 when the loop
        stopped early at a bad step (the step numbered global_step + 1, not counted, not applied);
      skipped_updates: steps whose update did not happen (bad ones and loss-scale overflows);
      gradients (with options.gradients): the summed gradients of the loop's last step, as the first
        local replica holds them (the same on every replica), for histograms.
    fetched: a local int64 variable counting the batches taken from `iterator` (the stall watch's).
    """
    options = options or LoopOptions()
    metric_names = tuple(task.train_metrics)
    names = metric_names + (task.updater.summary_names if options.update_summaries else ())
    replica_step = _TrainStep(task, metric_names, options)
    loss_index = 2 * metric_names.index("loss") if options.loss_upper_bound else 0

    def first_local(value):  # computed from summed values: any local replica's copy is everyone's
        return strategy.experimental_local_results(value)[0]

    def kept_gradients(outcome, last):
        local = [first_local(g) for g in outcome.gradients]
        return [tf.cast(g, tf.float32) for g in local] if len(local) == len(last) else last

    def train_loop(iterator, num_steps):
        feed = _Feed(strategy, iterator, replica_step, fetched)
        totals = tf.zeros([2 * len(names)])
        steps, bad_steps, skipped_updates = tf.constant(0), tf.constant(0), tf.constant(0)
        last = [tf.zeros(v.shape, tf.float32) for v in task.model.trainable_variables] if options.gradients else []
        following, stopped = feed.start(), tf.constant(False)
        # One boolean condition (not a `break`, nor Python's and/not of tensors: each a cond per step).
        while tf.logical_and(steps < num_steps, tf.logical_not(stopped)):
            batch, following = feed.next(following)
            outcome = strategy.run(feed.step, args=(batch,))
            step_totals = _reduce(strategy, outcome.stacked)
            # The update's summaries (after the metrics in the vector) stay out: `bad` covers the gradients.
            verdict = step_verdict(
                first_local(outcome.bad),
                step_totals[: 2 * len(metric_names)],
                skip_nonfinite=options.skip_nonfinite,
                loss=step_totals[loss_index : loss_index + 2],
                loss_upper_bound=options.loss_upper_bound,
            )
            totals += tf.where(verdict.good, step_totals, 0.0)  # a bad step's (maybe NaN) metrics stay out
            bad_steps += 1 - tf.cast(verdict.good, tf.int32)
            skipped_updates += verdict.counted * (1 - tf.cast(first_local(outcome.applied), tf.int32))
            steps += verdict.counted
            global_step.assign_add(tf.cast(verdict.counted, global_step.dtype))
            stopped = verdict.stop
            if options.gradients:
                last = kept_gradients(outcome, last)
        feed.finish()
        result = {
            "totals": _unstacked(totals, names),
            "steps": steps,
            "bad_steps": bad_steps,
            "skipped_updates": skipped_updates,
            # after the loop's updates; read here, in the graph, not by eager ops after the call
            "learning_rate": tf.cast(task.optimizer.learning_rate, tf.float32),
        }
        if options.gradients:
            result["gradients"] = last
        return result

    compiled = [compiled_unless_eager(train_loop, options.run_eagerly)]

    def run(iterator, num_steps):
        # A raw merge_call where TensorFlow cannot run one is refused in one line, not a traceback;
        # so is any other mistake of the Task's code found while tracing (user_code.step_errors_named).
        with (
            user_code.step_errors_named("the training loop", eager=options.run_eagerly),
            step_context.raw_collectives_refused(options.accum_steps, options.jit_compile),
        ):
            try:
                return compiled[0](iterator, num_steps)
            except step_context.CollectiveInLoop:
                # The step calls Task.all_reduce/all_gather inside the micro-batch while_loop, where
                # MirroredStrategy cannot: trace again with the micro-batches unrolled (nothing ran yet).
                replica_step.unrolled = True
                compiled[0] = compiled_for_one_run(train_loop)
                return compiled[0](iterator, num_steps)

    run.experimental_get_tracing_count = lambda: compiled[0].experimental_get_tracing_count()
    return run


def _eval_result(totals, names, collected) -> dict:
    """The eval loop's result from its summed vector [metrics' (total, count)..., examples, non-finite ones]."""
    return {
        "totals": _unstacked(totals[:-2], names),
        "examples": totals[-2],
        "nonfinite_examples": totals[-1],
        "collected": collected,
    }


class _CollectsFound(Exception):
    """The first trace of eval_step called self.collect: the loop is traced again with one
    host-side buffer per collected name (nothing ran yet)."""


def several_workers(strategy) -> bool:
    """The strategy spans several workers (each holds only its replicas' values)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False  # one process holds every replica
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def make_eval_loop(strategy, task, progress=None, run_eagerly=False):
    """eval_loop(distributed_dataset) -> {"totals": {name: (total, count)}, "examples": how many
    examples the replicas evaluated, "nonfinite_examples": how many of them hold a NaN or Inf in a
    floating-point tensor of the batch, "collected": {name: tensor}} over EVERY example of the dataset
    (the engine counts them itself, so a run can check that the whole eval set was seen exactly
    once). "collected" holds what eval_step handed to Task.collect: each step's local replicas'
    rows concatenated in replica order (a batch's examples are split across replicas in order, so
    this is the eval set's order), the steps' in turn, in host memory. `progress`: a local int64
    variable counting evaluated batches (the stall watch's). run_eagerly: a Python loop
    (--run_eagerly), eval_step runs as plain Python."""
    names = tuple(task.eval_metrics)
    task_step = _float32_outputs(task.eval_step, names, "eval_step")
    collects = {}  # name -> (dtype, per-example shape) of what eval_step collects, from its first trace

    def replica_step(batch):  # the metrics' (total, count), the batch's examples and its non-finite ones, one vector
        examples = tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.float32)
        with step_context.collecting() as collected, step_context.evaluating(batch):
            outputs = task_step(batch)
        found = {name: (t.dtype, tuple(t.shape[1:])) for name, t in collected.items()}
        if found and not collects:
            if several_workers(strategy):
                raise UserError(
                    "eval_step calls self.collect, which needs every eval example in one process; "
                    "several workers hold only their shards: evaluate with a sidecar or --mode=eval"
                )
            collects.update(found)
            raise _CollectsFound()
        if found != collects:
            raise UserError(
                f"eval_step collected {sorted(found)} in one trace and {sorted(collects)} in another; "
                "collect the same names (dtypes, shapes) in every eval_step"
            )
        vector = tf.concat([_stacked(outputs, names), [examples, _nonfinite_examples(batch)]], 0)
        return vector, [collected[name] for name in collects]

    def eval_loop(distributed_dataset):
        if collects:
            return collecting_loop(distributed_dataset)
        totals = tf.zeros([2 * len(names) + 2])
        for batch in distributed_dataset:
            vector, _ = strategy.run(replica_step, args=(batch,))
            totals += _reduce(strategy, vector)
            if progress is not None:
                progress.assign_add(1)
        return _eval_result(totals, names, {})

    def collecting_loop(distributed_dataset):
        """eval_loop with one TensorArray per collected name, in host memory (a `for` over a
        distributed dataset cannot carry TensorArrays: the iterator's optional is looped on instead)."""
        totals = tf.zeros([2 * len(names) + 2])
        with tf.device("CPU:0"):
            buffers = [
                tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False, element_shape=[None, *shape])
                for dtype, shape in collects.values()
            ]
        index, iterator = tf.constant(0), iter(distributed_dataset)
        following = iterator.get_next_as_optional()
        while following.has_value():
            vector, collected = strategy.run(replica_step, args=(following.get_value(),))
            totals += _reduce(strategy, vector)
            with tf.device("CPU:0"):  # each step's local replicas' rows, in replica order
                buffers = [
                    buffer.write(index, tf.concat(strategy.experimental_local_results(value), 0))
                    for buffer, value in zip(buffers, collected)
                ]
            index += 1
            if progress is not None:
                progress.assign_add(1)
            following = iterator.get_next_as_optional()
        with tf.device("CPU:0"):
            collected = {name: buffer.concat() for name, buffer in zip(collects, buffers)}
        return _eval_result(totals, names, collected)

    compiled = [compiled_unless_eager(eval_loop, run_eagerly)]

    def run(distributed_dataset):
        with user_code.step_errors_named("the evaluation loop", eager=run_eagerly):
            try:
                return compiled[0](distributed_dataset)
            except _CollectsFound:
                compiled[0] = compiled_unless_eager(eval_loop, run_eagerly)
                return compiled[0](distributed_dataset)

    run.experimental_get_tracing_count = lambda: compiled[0].experimental_get_tracing_count()
    return run


def _nonfinite_examples(batch) -> tf.Tensor:
    """How many examples of `batch` hold a NaN or Inf: per floating-point tensor the rows (first
    axis) with one, the most over its tensors (tensors of a batch need not share their rows)."""
    counts = [tf.constant(0.0)]
    for tensor in tf.nest.flatten(batch):
        if tensor.dtype.is_floating and tensor.shape.rank:
            finite = tf.math.is_finite(tensor)
            rows = tf.reduce_all(finite, axis=list(range(1, tensor.shape.rank))) if tensor.shape.rank > 1 else finite
            counts.append(tf.reduce_sum(1.0 - tf.cast(rows, tf.float32)))
    return tf.reduce_max(tf.stack(counts))


def ratios(totals) -> dict:
    """{name: total / count} as Python floats (one host sync for the whole dict)."""
    values = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, totals)
    return {name: float(total) / float(count) if count else float("nan") for name, (total, count) in values.items()}
