"""What a user sees in TensorBoard, checked in a real browser: headless Chromium (Debian's
`chromium`, installed by .ci/run) opens each dashboard of a `tensorboard` on 127.0.0.1 and the test
reads the rendered page (text and loaded images, shadow DOM included) through docs/screenshots.py,
the script that also makes the screenshots in docs/screenshots/."""

from __future__ import annotations

import os
import re
import shutil

import matplotlib.image
import numpy as np
import pytest
from helpers import QUIET, REPO, screenshots_script, small_config

from engine.controller.trainer import train
from engine.data.builtin import DEBIAN_FASHION_MNIST_DIR

pytestmark = pytest.mark.skipif(
    not os.path.isdir(DEBIAN_FASHION_MNIST_DIR) or shutil.which("chromium") is None,
    reason="Debian packages missing (apt-get install dataset-fashion-mnist chromium; .ci/run does)",
)


def test_the_dashboards_show_the_runs_pictures_curves_layout_and_text(tmp_path):
    logdir = tmp_path / "runs"
    train(
        small_config(logdir / "fashion", dataset="fashion_mnist", train_steps=4, steps_per_loop=2, eval_every=2),
        **QUIET,
    )
    train(
        small_config(
            logdir / "gan",
            task=os.path.join(REPO, "examples", "gan.py:GanTask"),
            model="mlp",
            global_batch=32,
            train_steps=2,
            steps_per_loop=2,
        ),
        **QUIET,
    )
    screenshots = screenshots_script()
    needles = {
        "images": ["confusion_matrix", "misclassified", "<img"],
        "pr_curves": ["pr_curves/T-shirt_top", "class 9 (Ankle boot) against the rest"],
        "custom_scalars": ["loss (train and eval)", "loss (fashion/train)", "loss (fashion/eval)"],
        "text": ["class_names", "Ankle boot", "recall"],
    }
    shots = screenshots.take(str(logdir), str(tmp_path / "shots"), needles)

    for dashboard, (path, text) in shots.items():
        missing = [needle for needle in needles[dashboard] if needle not in text]
        assert not missing, f"{dashboard}: the page lacks {missing}:\n{text[:3000]}"
        assert "No " not in text.split("Toggle All Runs")[-1][:200], f"{dashboard} says it found no data"
        picture = matplotlib.image.imread(path)
        assert picture.shape[:2] == (screenshots.WINDOW[1], screenshots.WINDOW[0])
        assert picture[..., :3].std() > 0.05, f"{dashboard}: a blank screenshot"

    images = shots["images"][1]
    # The confusion matrix loaded as a matplotlib figure (hundreds of pixels, not a 248-pixel bitmap),
    # and the GAN Task's own figure is listed under its own tag.
    sizes = [(int(w), int(h)) for w, h in re.findall(r"<img (\d+)x(\d+) ", images)]
    assert sizes and max(w for w, _ in sizes) >= 600, sizes
    assert "samples" in images and "gan/eval" in images
    # Every class has its PR curve, named by its class.
    curves = shots["pr_curves"][1]
    assert all(f"class {i} (" in curves for i in range(10))
    # Custom Scalars: train and eval loss matched by one chart.
    scalars = shots["custom_scalars"][1]
    assert "Matches (2)" in scalars.split("loss (train and eval)")[1].split("accuracy (train and eval)")[0]
    assert np.isfinite(matplotlib.image.imread(shots["text"][0])).all()
