"""The second worked example: --dataset=text:PATH (engine/data/text.py) and --task=language_model
(engine/tasks/language_model.py), whose loss divides by the GLOBAL number of real tokens."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import QUIET, max_difference, small_config, tensorboard_run
from engine.controller.state import create_state
from engine.controller.trainer import train
from engine.data import text
from engine.data.spec import DataSpec
from engine.distribute.strategy import build_strategy
from engine.loop import make_train_loop
from engine.tasks.language_model import LanguageModelTask
from tasks_equivalence import LocalTokenMeanTask

FORTUNES = "/usr/share/games/fortunes/fortunes"
SEQ = 16
BATCH = 8  # global; replica 0 of 2 gets rows 0-3, replica 1 rows 4-7
LEARNING_RATE = 0.5


@pytest.mark.fast
def test_windows_predict_every_byte_once_and_pad_the_tail():
    tokens = np.frombuffer(b"abcdefghij", np.uint8)  # 9 targets: windows of 4 -> 4 + 4 + 1 (3 padded)
    features, labels = text.windows(tokens, 4)
    assert features.dtype == labels.dtype == np.int32 and features.shape == labels.shape == (3, 4)
    assert bytes(features[0].astype(np.uint8)) == b"abcd" and bytes(labels[0].astype(np.uint8)) == b"bcde"
    assert bytes(features[1].astype(np.uint8)) == b"efgh" and bytes(labels[1].astype(np.uint8)) == b"fghi"
    assert features[2].tolist() == [ord("i"), ord("j"), 0, 0]
    assert labels[2].tolist() == [ord("j"), text.PAD_LABEL, text.PAD_LABEL, text.PAD_LABEL]
    real = labels[labels >= 0]
    assert real.tolist() == list(tokens[1:])


@pytest.mark.fast
def test_text_source_splits_the_last_tenth_and_reads_a_directory(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.txt").write_text("ünïcode bytes " * 20)
    (tmp_path / "index.dat").write_bytes(b"\x00\x01\xff binary")
    os.symlink(tmp_path / "a.txt", tmp_path / "a.u8")
    source = text.load(str(tmp_path), small_config(tmp_path, seq_len=32))
    assert source.spec.num_classes == 256 and source.spec.input_shape == (32,)
    assert source.spec.labels.shape == (32,) and source.spec.labels.dtype == tf.int32
    assert "2 text files" in source.where and "2 non-text or duplicate" in source.where
    total = len(b"hello world " * 50) + 1 + len("ünïcode bytes ".encode() * 20)
    targets = (source.y_train >= 0).sum() + (source.y_test >= 0).sum()
    assert targets == total - 2  # each split's first byte is not a target
    assert (source.y_test >= 0).sum() == int(total * text.TEST_FRACTION) - 1


def _padded_batch(uneven: bool):
    """A global batch whose first half (replica 0's, on 2 replicas) is mostly padding when uneven."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, 256, size=(BATCH, SEQ)).astype(np.int32)
    if uneven:
        labels[: BATCH // 2, 3:] = text.PAD_LABEL  # replica 0: 4 x 3 = 12 real tokens; replica 1: 64
    else:
        labels[:, SEQ - 2 :] = text.PAD_LABEL
    return tokens, labels


def _trained(tmp_path, task_class, replicas, batch, steps=3):
    """(weights before, weights after `steps` SGD steps on `batch`, reported train loss)."""
    placement = build_strategy("mirrored", cpu_replicas=replicas)
    config = small_config(
        tmp_path / f"{task_class.__name__}{replicas}",
        task="language_model",
        seq_len=SEQ,
        global_batch=BATCH,
        optimizer="sgd",
        learning_rate=LEARNING_RATE,
    )
    task = task_class(config, DataSpec(tf.TensorSpec((SEQ,), tf.int32), tf.TensorSpec((SEQ,), tf.int32), 256))
    keras.utils.set_random_seed(3)
    state = create_state(placement.strategy, task, seed=3, model_dir=config.model_dir, is_chief=True, keep=1)
    before = [v.numpy() for v in task.model.trainable_variables]
    loop = make_train_loop(placement.strategy, task, state.global_step)
    dataset = tf.data.Dataset.from_tensors(tuple(tf.constant(a) for a in batch)).repeat()
    result = loop(iter(placement.strategy.experimental_distribute_dataset(dataset)), tf.constant(steps))
    total, count = (float(t) for t in result["totals"]["loss"])
    return before, [v.numpy() for v in task.model.trainable_variables], total / count, task


def test_one_step_follows_the_mean_over_real_tokens(tmp_path):
    """One replica, padded batch: the SGD step is exactly -lr x the gradient of the mean loss over
    the REAL tokens (a constant divisor such as global_batch x seq_len would be smaller)."""
    batch = _padded_batch(uneven=True)
    before, after, reported, task = _trained(tmp_path, LanguageModelTask, 1, batch, steps=1)
    real = batch[1] >= 0
    for v, w in zip(task.model.trainable_variables, before):
        v.assign(w)
    with tf.GradientTape() as tape:
        logits = task.model(batch[0], training=True)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(np.where(real, batch[1], 0), logits)
        mean = tf.reduce_sum(tf.where(real, losses, 0.0)) / real.sum()
    gradients = tape.gradient(mean, task.model.trainable_variables)
    np.testing.assert_allclose(reported, float(mean), rtol=1e-5)
    for w, g, new in zip(before, gradients, after):
        np.testing.assert_allclose(new, w - LEARNING_RATE * tf.convert_to_tensor(g).numpy(), atol=2e-6)


def test_two_replicas_match_one_with_uneven_padding(tmp_path):
    batch = _padded_batch(uneven=True)
    before, one, loss_one, _ = _trained(tmp_path, LanguageModelTask, 1, batch)
    _, two, loss_two, _ = _trained(tmp_path, LanguageModelTask, 2, batch)
    assert max_difference(one, before) > 1e-3, "training must move the weights"
    assert max_difference(one, two) < 1e-5
    assert loss_one == pytest.approx(loss_two, rel=1e-5)


def test_local_token_count_breaks_equivalence_only_when_padding_is_uneven(tmp_path):
    """Dividing by each replica's own count (x replicas) passes when every replica holds as many
    real tokens, and fails once replica 0 holds 12 real tokens and replica 1 holds 64."""
    even = _padded_batch(uneven=False)
    _, one, _, _ = _trained(tmp_path / "even", LocalTokenMeanTask, 1, even)
    _, two, _, _ = _trained(tmp_path / "even", LocalTokenMeanTask, 2, even)
    assert max_difference(one, two) < 1e-5
    uneven = _padded_batch(uneven=True)
    _, one, _, _ = _trained(tmp_path / "uneven", LocalTokenMeanTask, 1, uneven)
    _, two, _, _ = _trained(tmp_path / "uneven", LocalTokenMeanTask, 2, uneven)
    assert max_difference(one, two) > 1e-3


def _english_like_text(path):
    """A generated English-like text (used when the fortunes files are missing)."""
    rng = np.random.default_rng(0)
    words = (
        "the of and to in is was that for it with as his on be at by had not are but from or have an "
        "they which one you were her all she there would their we him been has when who will more no if "
        "out so said what up its about into than them can only other new some time could these two may "
        "then do first any my now such like our over man me even most made after also did many before"
    ).split()
    sentences = [" ".join(rng.choice(words, size=rng.integers(4, 12))).capitalize() + "." for _ in range(3000)]
    path.write_text("\n".join(sentences))
    return str(path)


def test_perplexity_beats_unigram_and_sample_reaches_tensorboard(tmp_path):
    path = FORTUNES if os.path.isfile(FORTUNES) else _english_like_text(tmp_path / "english.txt")
    tokens, where = text.read_bytes(path)
    unigram = text.unigram_perplexity(*text.split(tokens, 64, where))
    config = small_config(
        tmp_path / "run",
        task="language_model",
        dataset=f"text:{path}",
        seq_len=64,
        global_batch=32,
        train_steps=40,
        steps_per_loop=20,
        eval_every=40,
    )
    result = train(config, **QUIET)
    perplexity = result.eval_metrics["perplexity"]
    assert perplexity == pytest.approx(np.exp(result.eval_metrics["loss"]), rel=1e-6)
    assert perplexity < 0.75 * unigram, (perplexity, unigram)
    events = tensorboard_run(tmp_path / "run" / "eval")
    samples = events.Tensors("sample")
    assert [e.step for e in samples] == [40]
    sample = tf.make_ndarray(samples[0].tensor_proto).item().decode()
    assert LanguageModelTask.PROMPT in sample and len(sample) > LanguageModelTask.SAMPLE_BYTES
    scalars = {tag for tag in events.Tags()["tensors"]}
    assert "perplexity" in scalars
