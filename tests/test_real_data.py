"""Real Fashion-MNIST (Debian package dataset-fashion-mnist), when its files are installed."""

from __future__ import annotations

import os
import re

import pytest

from helpers import run_cli
from engine.data.builtin import DEBIAN_FASHION_MNIST_DIR

pytestmark = pytest.mark.skipif(
    not os.path.isdir(DEBIAN_FASHION_MNIST_DIR),
    reason=f"{DEBIAN_FASHION_MNIST_DIR} missing (apt-get install dataset-fashion-mnist)",
)


def _test_accuracy(stdout: str) -> float:
    match = re.search(r"^done +test loss [0-9.]+ +accuracy ([0-9.]+)", stdout, re.MULTILINE)
    assert match, stdout
    return float(match.group(1))


def test_two_replicas_learn_fashion_mnist(tmp_path):
    result = run_cli(
        "--strategy=mirrored",
        "--cpu_replicas=2",
        "--dataset=fashion_mnist",
        "--global_batch=256",
        "--train_steps=150",
        "--steps_per_loop=50",
        "--seed=1",
        f"--model_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "60000 train / 10000 test" in result.stdout
    assert "global batch 256 = 2 replicas x 128" in result.stdout
    assert _test_accuracy(result.stdout) > 0.75


@pytest.mark.slow
def test_full_three_epochs_on_two_replicas(tmp_path):
    result = run_cli(
        "--strategy=mirrored",
        "--cpu_replicas=2",
        "--dataset=fashion_mnist",
        "--global_batch=256",
        "--epochs=3",
        "--seed=1",
        f"--model_dir={tmp_path}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert _test_accuracy(result.stdout) > 0.88


@pytest.mark.slow
def test_cnn_bn_reaches_092(tmp_path):
    """The batch-norm CNN with a cosine learning rate: 0.9204 test accuracy after 12 epochs when
    measured (5:06 on 2 cores), hence the bound and the timeout. A constant rate wanders by about
    +-0.6 % between epochs, more than the bound allows."""
    result = run_cli(
        "--dataset=fashion_mnist",
        "--model=cnn_bn",
        "--epochs=12",
        "--global_batch=128",
        "--lr_schedule=cosine",
        "--seed=1",
        f"--model_dir={tmp_path}",
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert _test_accuracy(result.stdout) >= 0.915
