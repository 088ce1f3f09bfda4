"""The worked examples of examples/ (docs/examples.md): each trains (in float32 and in mixed_float16
on 2 replicas) and computes what its docstring says (one SGD step, or the loss, checked against a
plain TensorFlow or NumPy computation), and each keeps the engine's guarantees with several models
and optimizers: 2 replicas == 1, exact resume of both GAN models and both optimizers, SAM under
accumulation and past a non-finite gradient, k discriminator steps per generator step, a frozen
teacher (from a file or not) that never moves, training that survives crashing summaries."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    QUIET,
    REPO,
    TASKS_REFUSED,
    checkpoint_state,
    exported_by_name,
    max_difference,
    small_config,
    tensorboard_run,
)

from engine.controller.state import create_state
from engine.controller.trainer import train
from engine.data.spec import DataSpec
from engine.distribute.strategy import build_strategy
from engine.errors import ExtraFailed, UserError
from engine.loop import make_train_loop
from engine.task_state import top_level_names
from examples.distillation import DistillationTask
from examples.gan import GanTask
from examples.gradient_penalty import GradientPenaltyTask
from examples.sam import SamTask

TWO = dict(strategy="mirrored", cpu_replicas=2)
STATE = ("model/", "optimizer/", "task/")
EXAMPLES = {
    name: os.path.join(REPO, "examples", f"{file}.py:{name}")
    for file, name in (
        ("sam", "SamTask"),
        ("distillation", "DistillationTask"),
        ("gradient_penalty", "GradientPenaltyTask"),
        ("gan", "GanTask"),
        ("gan", "TwoDiscriminatorStepsGanTask"),
    )
}
LEARNING_RATE = 0.5  # the one-step tests' SGD rate: large, so a wrong gradient shows


def _config(tmp_path, example, name="run", **overrides):
    gan = {"global_batch": 32} if "Gan" in example else {}  # the convolutional GAN: smaller batches, faster
    return small_config(tmp_path / name, **{"task": EXAMPLES[example], "model": "mlp", **gan, **overrides})


def _iterations(model_dir, node) -> int:
    state = checkpoint_state(model_dir, prefixes=(node + "/",))
    return int(next(v for k, v in state.items() if k.startswith(node + "/_iterations")))


def _discriminator_weights(state: dict) -> int:
    """How many of the GAN discriminator's weights a checkpoint_state holds. A checkpoint stores each
    variable once, at its first path: the discriminator's weights sit under its optimizer's
    _trainable_variables (task/discriminator is in the object graph, with no variable of its own)."""
    return len([k for k in state if k.startswith("task/d_optimizer/_trainable_variables/")])


def _one_sgd_step(tmp_path, task_class, images, labels, **overrides):
    """(task, trainable weights before, after) one engine step of `task_class` (mlp, SGD at
    LEARNING_RATE, one replica) on the global batch (images, labels); the task's model is left at
    the weights before the step, to compute the expected step with plain TensorFlow."""
    placement = build_strategy("mirrored", cpu_replicas=1)
    config = small_config(
        tmp_path / task_class.__name__,
        model="mlp",
        global_batch=len(labels),
        optimizer="sgd",
        learning_rate=LEARNING_RATE,
        **overrides,
    )
    task = task_class(config, DataSpec.classification(images.shape[1:], 3))
    keras.utils.set_random_seed(3)
    state = create_state(placement.strategy, task, seed=3, model_dir=config.model_dir, is_chief=True, keep=1)
    before = [v.numpy() for v in task.model.trainable_variables]
    loop = make_train_loop(placement.strategy, task, state.global_step)
    dataset = tf.data.Dataset.from_tensors((tf.constant(images), tf.constant(labels))).repeat()
    loop(iter(placement.strategy.experimental_distribute_dataset(dataset)), tf.constant(1))
    after = [v.numpy() for v in task.model.trainable_variables]
    for v, w in zip(task.model.trainable_variables, before):
        v.assign(w)
    return task, before, after


def _batch(n=8, features=4):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, features)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


def _mean_cross_entropy_gradient(model, images, labels):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, model(images), from_logits=True))
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _assert_sgd_step(before, after, gradients, atol=2e-6):
    for w, g, new in zip(before, gradients, after):
        np.testing.assert_allclose(new, w - LEARNING_RATE * g, atol=atol)


# ---- each example trains ----


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_trains(tmp_path, example):
    result = train(_config(tmp_path, example), **QUIET)
    assert result.final_step == 6
    assert all(np.isfinite(v) for v in result.train_metrics.values()), result.train_metrics
    assert all(np.isfinite(v) for v in result.eval_metrics.values()), result.eval_metrics
    if "Gan" in example:
        assert set(result.train_metrics) >= {"d_loss", "g_loss", "grad_norm", "grad_norm/d_optimizer"}
        assert 0 <= result.eval_metrics["d_real"] <= 1 and 0 <= result.eval_metrics["d_fake"] <= 1
        samples = tensorboard_run(tmp_path / "run" / "eval").Tensors("samples")[-1]
        width, height = (int(v) for v in tf.make_ndarray(samples.tensor_proto)[:2])
        assert (width, height) == (600, 640)  # the Task's matplotlib figure, 6 x 6.4 inches at 100 dpi


@pytest.mark.parametrize("example", ["SamTask", "DistillationTask", "GradientPenaltyTask", "GanTask"])
def test_each_example_trains_in_mixed_float16_on_two_replicas(tmp_path, example):
    """Loss scaling: every loss an example differentiates goes through self.scale_loss."""
    result = train(_config(tmp_path, example, precision="mixed_float16", **TWO), **QUIET)
    assert result.final_step == 6
    assert all(np.isfinite(v) for v in result.train_metrics.values()), result.train_metrics


@pytest.mark.fast
def test_the_gan_refuses_data_that_are_not_images_it_can_make():
    with pytest.raises(UserError, match=r"divisible by 4; the data's examples are \(4,\)"):
        GanTask(small_config("/unused"), input_shape=(4,), num_classes=3).build_model()


# ---- each computes what it says ----


def test_sam_step_is_the_gradient_at_the_perturbed_weights_applied_at_w(tmp_path):
    images, labels = _batch()
    task, before, after = _one_sgd_step(tmp_path, SamTask, images, labels)
    variables = task.model.trainable_variables
    g = _mean_cross_entropy_gradient(task.model, images, labels)
    norm = np.sqrt(sum(np.sum(x * x) for x in g))
    for v, w, x in zip(variables, before, g):
        v.assign(w + SamTask.rho * x / norm)
    sharp = _mean_cross_entropy_gradient(task.model, images, labels)
    _assert_sgd_step(before, after, sharp)
    plain = max(float(np.max(np.abs(new - (w - LEARNING_RATE * x)))) for w, x, new in zip(before, g, after))
    assert plain > 1e-4, "a plain gradient step would pass too: rho too small to tell"


class _SamOnNanImages(SamTask):
    def train_step(self, batch):
        images, labels = batch
        return super().train_step((images * float("nan"), labels))


def test_sam_leaves_the_weights_finite_after_a_non_finite_gradient(tmp_path):
    """A NaN gradient at w: the perturbation is skipped (assign_sub of NaN would not undo assign_add
    of NaN) and the engine skips the update (--on_nonfinite=skip: the guarded update), so the
    weights stay exactly what they were."""
    images, labels = _batch()
    _, before, after = _one_sgd_step(tmp_path, _SamOnNanImages, images, labels, on_nonfinite="skip")
    for w, new in zip(before, after):
        np.testing.assert_array_equal(new, w)


def test_gradient_penalty_step_penalises_each_examples_own_input_gradient(tmp_path):
    images, labels = _batch()
    task, before, after = _one_sgd_step(tmp_path, GradientPenaltyTask, images, labels)
    model, weight = task.model, GradientPenaltyTask.weight
    with tf.GradientTape() as tape:
        total = 0.0
        for i in range(len(labels)):  # each example alone: its own input gradient, by construction
            x = tf.constant(images[i : i + 1])
            with tf.GradientTape() as input_tape:
                input_tape.watch(x)
                loss = keras.losses.sparse_categorical_crossentropy(labels[i : i + 1], model(x), from_logits=True)[0]
            total += loss + weight * tf.reduce_sum(tf.square(input_tape.gradient(loss, x)))
        mean = total / len(labels)
    gradients = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(mean, model.trainable_variables)]
    _assert_sgd_step(before, after, gradients)
    without = _mean_cross_entropy_gradient(model, images, labels)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(gradients, without)) > 1e-4, "the penalty must count"


def test_distillation_loss_is_the_weighted_kl_to_the_teacher_plus_cross_entropy():
    task = DistillationTask(small_config("/unused"), input_shape=(4,), num_classes=3)
    logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], np.float32)
    teacher = np.array([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    labels = np.array([0, 2])
    t, alpha = task.temperature, task.alpha

    def softmax(z):
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    p, q = softmax(teacher / t), softmax(logits / t)
    kl = (p * np.log(p / q)).sum(axis=1)
    cross_entropy = -np.log(softmax(logits)[np.arange(2), labels])
    per_example, distill, hard = (x.numpy() for x in task.distillation_loss(labels, logits, teacher))
    np.testing.assert_allclose(distill, t * t * kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hard, cross_entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(per_example, alpha * t * t * kl + (1 - alpha) * cross_entropy, rtol=1e-5, atol=1e-6)


# ---- the engine's guarantees with several models and optimizers ----


@pytest.mark.parametrize("example", ["GanTask", "SamTask"])
def test_two_replicas_train_like_one(tmp_path, example):
    """2 replicas and 1 fed the same global batches end at the same weights and optimizer state.
    The GAN runs 4 steps (2 loops), not 20: Adam grows its float rounding (summation order) to
    learning-rate size (next test), faster where oneDNN's per-replica and whole-batch kernels round
    differently from the first step (an Intel Xeon host: 3e-7 apart after 8 steps; an AMD EPYC host:
    6e-5 after 8, within 1e-5 after 4; deterministic run to run). An optimizer whose gradients were
    not summed over the replicas would be apart by Adam's first step alone: +-2e-4 (the learning
    rate) for every weight whose gradient changes sign between a half batch and the whole one."""
    steps = 4 if example == "GanTask" else 20
    run = dict(global_batch=64, train_steps=steps, steps_per_loop=steps // 2)
    train(_config(tmp_path, example, "two", **run, **TWO), **QUIET)
    train(_config(tmp_path, example, "one", **run, strategy="default"), **QUIET)
    two, one = checkpoint_state(tmp_path / "two", STATE), checkpoint_state(tmp_path / "one", STATE)
    if example == "GanTask":  # both models and both optimizers are compared
        assert _discriminator_weights(two) == _discriminator_weights(one) == 6  # 3 layers: kernel, bias
    assert max_difference(two, one) <= 1e-5


def test_two_gan_replicas_train_like_one_replica_accumulating_their_halves(tmp_path):
    """The GAN is sensitive to summation order: at a global batch of 32, 20 steps on 2 replicas end
    0.02 away from one replica fed whole batches (Adam normalises the discriminator's nearly
    cancelling gradients, so float rounding grows to learning-rate size), and so does one replica
    that sums two micro-batches of 16. The engine's part is exact: 2 replicas == 1 replica
    accumulating the same halves (same latent vectors, same sums)."""
    run = dict(global_batch=32, train_steps=20, steps_per_loop=10)
    train(_config(tmp_path, "GanTask", "two", **run, **TWO), **QUIET)
    train(_config(tmp_path, "GanTask", "halves", **run, strategy="default", grad_accum_steps=2), **QUIET)
    two, halves = checkpoint_state(tmp_path / "two", STATE), checkpoint_state(tmp_path / "halves", STATE)
    assert max_difference(two, halves) <= 1e-6


def test_a_resumed_gan_equals_an_uninterrupted_one(tmp_path):
    train(_config(tmp_path, "GanTask", "resumed", train_steps=20, steps_per_loop=10), **QUIET)
    latest = tf.train.latest_checkpoint(os.path.join(tmp_path, "resumed", "checkpoints"))
    assert top_level_names(latest, "task") == {"discriminator", "d_optimizer"}
    train(_config(tmp_path, "GanTask", "resumed", train_steps=40, steps_per_loop=10), **QUIET)
    train(_config(tmp_path, "GanTask", "straight", train_steps=40, steps_per_loop=10), **QUIET)
    resumed, straight = checkpoint_state(tmp_path / "resumed", STATE), checkpoint_state(tmp_path / "straight", STATE)
    assert _discriminator_weights(resumed) == 6
    assert max_difference(resumed, straight) <= 1e-6
    assert _iterations(tmp_path / "resumed", "task/d_optimizer") == 40
    assert _iterations(tmp_path / "resumed", "optimizer") == 40


def test_sam_trains_with_accumulated_micro_batches(tmp_path):
    result = train(_config(tmp_path, "SamTask", grad_accum_steps=2, **TWO), **QUIET)
    assert result.final_step == 6 and np.isfinite(result.train_metrics["loss"])


def test_k_discriminator_steps_per_generator_step(tmp_path):
    train(
        _config(
            tmp_path,
            "TwoDiscriminatorStepsGanTask",
            global_batch=16,
            synthetic_test_examples=16,
            summaries="basic",
            **TWO,
        ),
        **QUIET,
    )
    assert _iterations(tmp_path / "run", "task/d_optimizer") == 6
    assert _iterations(tmp_path / "run", "optimizer") == 3


def test_the_frozen_teacher_is_checkpointed_and_never_moves(tmp_path):
    train(_config(tmp_path, "DistillationTask", "short", train_steps=3), **QUIET)
    train(_config(tmp_path, "DistillationTask", "long", train_steps=9), **QUIET)
    short, long = (checkpoint_state(tmp_path / n, ("task/teacher/",)) for n in ("short", "long"))
    assert short and max_difference(short, long) == 0.0


def test_the_teacher_comes_from_TEACHER_MODEL(tmp_path, monkeypatch):
    """A trained cnn teaches an mlp student on 2 replicas: the checkpoint holds the file's weights."""
    train(small_config(tmp_path / "teacher", model="cnn", export=True), **QUIET)
    path = os.path.join(tmp_path, "teacher", "export", "model.keras")
    monkeypatch.setenv("TEACHER_MODEL", path)
    result = train(_config(tmp_path, "DistillationTask", "student", **TWO), **QUIET)
    assert np.isfinite(result.train_metrics["distill"])
    held = list(checkpoint_state(tmp_path / "student", ("task/teacher/",)).values())
    exported = list(exported_by_name(tmp_path / "teacher").values())
    assert len(held) == len(exported) == 6  # the cnn's conv and 2 dense layers: kernels and biases
    for a in exported:
        assert any(a.shape == b.shape and np.array_equal(a, b) for b in held)


def test_a_gan_whose_summaries_crash_keeps_its_checkpoint(tmp_path):
    with pytest.raises(ExtraFailed, match="the summaries crash on purpose"):
        # no preflight: it would meet the failure before training (tests/test_preflight.py)
        train(
            small_config(tmp_path, task=f"{TASKS_REFUSED}:CrashingSummariesGanTask", model="mlp", preflight=False),
            **QUIET,
        )
    assert tf.train.latest_checkpoint(os.path.join(tmp_path, "checkpoints")).endswith("ckpt-6")


def test_a_gan_checkpoint_into_a_task_without_the_discriminator_is_refused(tmp_path):
    train(_config(tmp_path, "GanTask"), **QUIET)
    with pytest.raises(UserError, match=r"holds self\.d_optimizer, which this Task does not have"):
        train(
            small_config(
                tmp_path / "run",
                task=f"{TASKS_REFUSED}:GanWithoutDiscriminatorTask",
                model="mlp",
                train_steps=12,
                allow_config_change=True,
            ),
            **QUIET,
        )
