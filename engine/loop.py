"""The compiled inner loops: many `strategy.run` steps per tf.function call.

Each step's metrics {name: (total, count)} are stacked into one vector on each replica, reduced
across replicas with ONE strategy.reduce(SUM) per step and summed over the steps of the loop. The
step count is a tensor, so a loop of any length reuses one trace (no retracing between the loops
of a run).

One training step, on each replica: the Task's train_step runs on each of the --grad_accum_steps
micro-batches of the replica's share of the global batch (their gradients, handed over with
Task.apply_gradients, are summed), then engine/update.py applies them once (one all-reduce). The
micro-batches run in a tf.while_loop, or unrolled when the model has layers that all-reduce in
their call (synchronised batch norm), since such a layer cannot merge_call inside a loop body.

A step is bad when a reduced metric total is not finite (a NaN/Inf loss on any replica) or when
the summed gradients are (and loss scaling does not explain it). Both are the same value on every
replica and worker, so every replica takes the same branch, and the decision stays on the device
(no host sync per step): with stop, the loop ends before counting the bad step (its update ran
beside the check, engine/update.py; the run then ends without saving); with skip (and rollback),
the step counts (its batch is consumed) but its metrics do not, and its update never happens.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import tensorflow as tf

from engine import compat, refused_combinations, update
from engine.errors import UserError

# Iterating a distributed dataset inside tf.function makes tf.data warn about options it cannot
# see at trace time; the engine sets its options before distributing, so the warning is noise.
warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data options")


def released_after_tracing(function):
    """`function` (a tf.function) with the custom gradients its tracing registered dropped after
    each call.

    An all-reduce in replica context (the engine's gradient sum, Task.all_reduce, synchronised batch
    norm) is a `tf.custom_gradient`, which registers its gradient in TensorFlow's global registry
    with tensors of the graph being traced in its closure: every loop ever traced stayed in memory
    with its whole graph (TF issue 97697; here about 75 MB a train() of the cnn, so a sweep of runs
    in one process grew without bound). A registration serves only while its graph's gradients are
    built, i.e. during the trace: once the call returns no one needs it. A call that traces nothing
    registers nothing and costs one dict lookup. It drops every registration made during the call,
    so a trace running at the same time in another thread of the process (the engine never does;
    its replica threads trace inside this call) could lose its own."""

    def call(*args):
        registry = compat.custom_gradient_registry()  # None: nothing is dropped
        last = next(reversed(registry), None) if registry else None
        try:
            return function(*args)
        finally:
            if registry and next(reversed(registry)) != last:  # insertion order: this call's are at the end
                for name in list(itertools.takewhile(lambda name: name != last, reversed(registry))):
                    if str(name).startswith(compat.CUSTOM_GRADIENT_PREFIX):
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
        return {name: (tf.cast(outputs[name][0], tf.float32), tf.cast(outputs[name][1], tf.float32)) for name in names}

    return replica_step


def _add(totals, more):
    return {name: (totals[name][0] + more[name][0], totals[name][1] + more[name][1]) for name in totals}


class _TrainStep:
    """One replica's training step: micro-batches, then the engine's update."""

    def __init__(
        self,
        task,
        names,
        accum_steps: int,
        jit_compile: bool,
        update_summaries: bool,
        keep_gradients: bool,
        models=None,
        strategy_name: str = "",
    ):
        self.task, self.accum_steps = task, accum_steps
        self.update_summaries, self.keep_gradients = update_summaries, keep_gradients
        # The stacked vector a step returns: these names' (total, count), in this order.
        self.names = tuple(names) + (task.updater.summary_names if update_summaries else ())
        self._step = _float32_outputs(task.train_step, names, "train_step")
        # What the last trace of the Task's step handed over (Python, trace time). Shared by the
        # replica threads on purpose: with jit_compile one trace serves every replica; the handed
        # structure (which gradients exist, their variables) is the same on all of them.
        self._handed = None
        merge_calls = strategy_name in refused_combinations.MERGE_CALL_STRATEGIES
        self.jit_strategy = strategy_name if jit_compile and merge_calls else None
        self._compute = tf.function(self._compute_fn, jit_compile=True) if jit_compile else self._compute_fn
        # The state a skipped update puts back: every trained model's non-trainable variables.
        self.models = list(models) if models is not None else [task.model]
        # A layer that all-reduces inside its call (synchronised batch norm) needs a merge_call,
        # which TensorFlow refuses inside a while_loop's body: such models run their micro-batches
        # unrolled in Python, each normalised by the statistics of that micro-batch on every replica.
        # So do steps that call Task.all_reduce (found when the loop body is traced: CollectiveInLoop).
        self.unrolled = any(refused_combinations.cross_replica_layers(model) for model in self.models)

    def _compute_fn(self, batch, example_offset, in_loop=False):
        """The Task's step on one micro-batch -> (metrics, gradients handed over or [], whens)."""
        with update.collecting(
            in_loop=in_loop, jit_strategy=self.jit_strategy, example_offset=example_offset
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
            more, grads, whens = self._compute(tf.nest.map_structure(lambda t: t[i], split), offset + i * size, in_loop)
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

    def __call__(self, batch):
        # Read before the forward pass moves them: put back if a guarded update is skipped.
        kept_state = update.snapshot(
            [v for model in self.models for v in model.non_trainable_variables] if self.task.updater.guarded else []
        )
        # This replica's first example in the global batch (training batches are whole).
        size = tf.shape(tf.nest.flatten(batch)[0])[0]
        offset = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int32) * size
        if self.accum_steps == 1:
            outputs, gradients, whens = self._compute(batch, offset)
        else:
            outputs, gradients, whens = self._micro_batches(batch, offset)
        handed, updater = self._handed, self.task.updater
        if not handed.hands:  # the Task updated by itself (or not at all)
            outcome = None
        else:
            if updater.loss_scaling and not handed.scaled:
                raise UserError(
                    "--precision=mixed_float16 scales the loss: train_step must take the "
                    "gradients of self.scale_loss(loss), not of the loss itself"
                )
            outcome = updater.apply(updater.groups(handed, whens), gradients, kept_state)
        if self.update_summaries:
            done = outcome.summaries if outcome is not None else {}
            outputs = dict(
                outputs,
                **{
                    name: (done[name], tf.constant(1.0)) if name in done else (tf.constant(0.0), tf.constant(0.0))
                    for name in updater.summary_names
                },
            )
        stacked = _stacked(outputs, self.names)
        if outcome is None:
            return stacked, tf.constant(False), tf.constant(True), []
        kept = outcome.gradients if self.keep_gradients else []
        return stacked, outcome.bad, outcome.applied, kept


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


def make_train_loop(
    strategy,
    task,
    global_step: tf.Variable,
    *,
    accum_steps: int = 1,
    jit_compile: bool = False,
    skip_nonfinite: bool = False,
    update_summaries: bool = False,
    gradients: bool = False,
    models=None,
    strategy_name: str = "",
    loss_upper_bound: float = 0.0,
    fetched=None,
):
    """train_loop(iterator, num_steps) -> dict with
      totals: {name: (total, count)} summed over replicas and the good steps; with update_summaries
        also the updater's summaries (e.g. "grad_norm": mean global norm per step of the summed
        gradients before clipping, "grad_norm/<optimizer>" for each other optimizer of the Task);
      learning_rate: the Task's optimizer's learning rate after the loop's last step;
      steps: the steps run, each added to `global_step` as it ends, so the counter matches the weights;
      bad_steps: with skip_nonfinite, how many steps were bad (skipped); otherwise 1 when the loop
        stopped early at a bad step (the step numbered global_step + 1, not counted, not applied);
      skipped_updates: steps whose update did not happen (bad ones and loss-scale overflows);
      gradients (with `gradients`): the summed gradients of the loop's last step, as the first local
        replica holds them (the same on every replica), for histograms.
    models: every model the Task trains (their non-trainable state is put back on a skipped step);
    strategy_name: --strategy (a collective in an XLA-compiled step is refused under merge_call strategies).
    fetched: a local int64 variable counting the batches taken from `iterator` (the stall watch's).
    loss_upper_bound: > 0: a step whose reduced "loss" exceeds it is bad too (a spike; its update has
      happened, so use it where a bad step is not kept: stop or rollback).
    """
    metric_names = tuple(task.train_metrics)
    summary_names = task.updater.summary_names if update_summaries else ()
    names = metric_names + summary_names
    replica_step = _TrainStep(
        task,
        metric_names,
        accum_steps,
        jit_compile,
        update_summaries,
        gradients,
        models=models,
        strategy_name=strategy_name,
    )

    def train_loop(iterator, num_steps):
        totals = tf.zeros([2 * len(names)])
        steps = tf.constant(0, tf.int32)
        bad_steps = tf.constant(0, tf.int32)
        skipped_updates = tf.constant(0, tf.int32)
        last = [tf.zeros(v.shape, tf.float32) for v in task.model.trainable_variables] if gradients else []
        # An iterator may hand over a reference that each replica turns into its batch
        # (input_mode=resident: indices, gathered on the replica's device).
        replica_batch = getattr(iterator, "replica_batch", None)
        # One replica on resident arrays: the next step's batch is gathered while this step runs
        # (two independent chains the executor runs side by side: +13 % on a 0.4 ms step); the
        # batch gathered for the step after the loop is given back, so the data position counts
        # exactly the steps taken. Several replicas gather inside the step: carrying their batches
        # as a loop variable measured slower on 2 logical CPU replicas (mlp 0.90x, cnn 0.90x).
        pipelined = replica_batch is not None and strategy.num_replicas_in_sync == 1
        gathers_in_step = replica_batch is not None and not pipelined
        run_step = (lambda reference: replica_step(replica_batch(reference))) if gathers_in_step else replica_step
        following = ()  # (autograph: a loop variable either way; empty unless pipelined)
        if pipelined:
            following = strategy.run(replica_batch, args=(next(iterator),))
        # The loop ends after num_steps steps or at a bad step (stop mode): one boolean condition
        # of the while loop. Not a `break` (autograph makes it a cond per step: 2-4 % of an mlp
        # step), nor Python's `and`/`not` of tensors (a StatelessIf in the loop's condition each
        # step: 0.932 against 0.940 of the bare mlp step, inside the noise, but never a gain).
        stopped = tf.constant(False)
        while tf.logical_and(steps < num_steps, tf.logical_not(stopped)):
            if pipelined:
                batch, following = following, strategy.run(replica_batch, args=(next(iterator),))
            else:
                batch = next(iterator)
            if fetched is not None:  # once the batch arrived (iterator and counter share no resource)
                with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)[:1]):
                    fetched.assign_add(1)
            stacked, bad, applied, kept = strategy.run(run_step, args=(batch,))
            step_totals = _reduce(strategy, stacked)
            if gradients:
                local = [strategy.experimental_local_results(g)[0] for g in kept]
                if len(local) == len(last):
                    last = [tf.cast(g, tf.float32) for g in local]
            # Computed from summed values, so any local replica's copy is everyone's value. The
            # update's summaries (after the metrics in the vector) stay out of the check: `bad`
            # already covers the gradients. A NaN/Inf anywhere makes the sum non-finite.
            good = tf.logical_and(
                tf.logical_not(strategy.experimental_local_results(bad)[0]),
                tf.math.is_finite(tf.reduce_sum(step_totals[: 2 * len(metric_names)])),
            )
            if loss_upper_bound:
                loss = 2 * metric_names.index("loss")
                good = tf.logical_and(good, step_totals[loss] <= loss_upper_bound * step_totals[loss + 1])
            # A bad step's (maybe NaN) metrics stay out of the totals. skip: it counts as a step
            # (its batch is consumed); stop: the loop ends before counting it.
            totals += tf.where(good, step_totals, 0.0)
            bad_steps += 1 - tf.cast(good, tf.int32)
            if skip_nonfinite:
                counted = tf.constant(1, tf.int32)
            else:
                counted, stopped = tf.cast(good, tf.int32), tf.logical_not(good)
            skipped_updates += counted * (1 - tf.cast(strategy.experimental_local_results(applied)[0], tf.int32))
            steps += counted
            global_step.assign_add(tf.cast(counted, global_step.dtype))
        if pipelined:
            iterator.give_back()
        totals = _unstacked(totals, names)
        result = {
            "totals": totals,
            "steps": steps,
            "bad_steps": bad_steps,
            "skipped_updates": skipped_updates,
            # after the loop's updates; read here, not eagerly after the call (a schedule's
            # eager ops cost 0.3 ms, ~1 % of a 100-step mlp loop)
            "learning_rate": tf.cast(task.optimizer.learning_rate, tf.float32),
        }
        if gradients:
            result["gradients"] = last
        return result

    compiled = [compiled_for_one_run(train_loop)]

    def run(iterator, num_steps):
        try:
            return compiled[0](iterator, num_steps)
        except update.CollectiveInLoop:
            # The step all-reduces (Task.all_reduce) inside the micro-batch while_loop, where
            # MirroredStrategy cannot: trace again with the micro-batches unrolled (nothing ran yet).
            replica_step.unrolled = True
            compiled[0] = compiled_for_one_run(train_loop)
            return compiled[0](iterator, num_steps)

    run.experimental_get_tracing_count = lambda: compiled[0].experimental_get_tracing_count()
    return run


def make_eval_loop(strategy, task, progress=None):
    """eval_loop(distributed_dataset) -> {"totals": {name: (total, count)}, "examples": how many
    examples the replicas evaluated} over EVERY example of the dataset (the engine counts them
    itself, so a run can check that the whole eval set was seen exactly once). `progress`: a local
    int64 variable counting evaluated batches (the stall watch's)."""
    names = tuple(task.eval_metrics)
    task_step = _float32_outputs(task.eval_step, names, "eval_step")

    def replica_step(batch):  # the metrics' (total, count) then the batch's examples, one vector
        examples = tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.float32)
        return tf.concat([_stacked(task_step(batch), names), [examples]], 0)

    def eval_loop(distributed_dataset):
        totals = tf.zeros([2 * len(names) + 1])
        for batch in distributed_dataset:
            totals += _reduce(strategy, strategy.run(replica_step, args=(batch,)))
            if progress is not None:
                progress.assign_add(1)
        return {"totals": _unstacked(totals[:-1], names), "examples": totals[-1]}

    return compiled_for_one_run(eval_loop)


def ratios(totals) -> dict:
    """{name: total / count} as Python floats (one host sync for the whole dict)."""
    values = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, totals)
    return {name: float(total) / float(count) if count else float("nan") for name, (total, count) in values.items()}
