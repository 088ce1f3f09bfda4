"""One run read back through a real `tensorboard --logdir` server on 127.0.0.1: its HTTP data API
lists the run's scalar tags, the images (and serves them as PNG) and the HParams session."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request

from helpers import QUIET, screenshots_script, small_config
from engine.controller.trainer import train

STARTUP_SECONDS = 60


def _get(base, path, body=None):
    request = urllib.request.Request(
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-XSRF-Protected": "1"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        data = response.read()
    return data if path.startswith("/data/plugin/images/individualImage") else json.loads(data)


def _wait_for(base, path, ready, server):
    """Polls path until ready(answer) holds (the server loads event files in the background)."""
    deadline = time.monotonic() + STARTUP_SECONDS
    last = None
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tensorboard exited with {server.returncode}"
        try:
            last = _get(base, path)
            if ready(last):
                return last
        except OSError:  # not listening yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"tensorboard did not answer {path} in {STARTUP_SECONDS} s; last answer {last}")


def test_tensorboard_server_shows_scalars_images_and_hparams(tmp_path):
    logdir = tmp_path / "run"
    train(small_config(logdir, train_steps=6, steps_per_loop=3, eval_every=3), **QUIET)
    server, base = screenshots_script().start_tensorboard(str(logdir))
    try:
        scalar_tags = _wait_for(
            base,
            "/data/plugin/scalars/tags",
            lambda tags: "grad_norm" in tags.get("train", {}) and "loss" in tags.get("eval", {}),
            server,
        )
        assert {"train", "eval"} <= set(_get(base, "/data/runs"))
        assert {
            "loss",
            "accuracy",
            "grad_norm",
            "learning_rate",
            "steps_per_sec",
            "examples_per_sec",
            "loop_seconds",
        } <= set(scalar_tags["train"])
        assert {"loss", "accuracy"} <= set(scalar_tags["eval"])

        image_tags = _get(base, "/data/plugin/images/tags")
        assert "sample_inputs" in image_tags["train"]
        assert {"confusion_matrix", "misclassified"} <= set(image_tags["eval"])
        entries = _get(base, "/data/plugin/images/images?run=eval&tag=confusion_matrix")
        assert [e["step"] for e in entries] == [3, 6]
        png = _get(base, "/data/plugin/images/individualImage?" + entries[-1]["query"])
        assert png.startswith(b"\x89PNG")

        experiment = _get(base, "/data/plugin/hparams/experiment", body={"experimentName": ""})
        assert {"global_batch", "optimizer", "engine_version"} <= {h["name"] for h in experiment["hparamInfos"]}
        assert {m["name"]["tag"] for m in experiment["metricInfos"]} == {"loss", "accuracy"}
        groups = _get(
            base,
            "/data/plugin/hparams/session_groups",
            body={
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                "colParams": [],
                "startIndex": 0,
                "sliceSize": 10,
            },
        )
        assert groups["totalSize"] == 1
        session = groups["sessionGroups"][0]
        assert session["hparams"]["global_batch"] == 64
        metrics = {m["name"]["tag"]: m for m in session["metricValues"]}
        assert metrics["accuracy"]["trainingStep"] == 6 and 0 <= metrics["accuracy"]["value"] <= 1
    finally:
        server.kill()
        server.wait(timeout=10)
