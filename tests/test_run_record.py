"""model_dir/config.json: written by a fresh run, compared on resume, unknown keys ignored."""

from __future__ import annotations

import json

import pytest

from helpers import QUIET, small_config
from engine.errors import UserError
from engine.controller.trainer import train


def test_config_json_records_the_run_and_guards_its_identity(tmp_path):
    config = small_config(tmp_path, model="mlp", train_steps=2, steps_per_loop=2)
    train(config, **QUIET)
    path = tmp_path / "config.json"
    record = json.loads(path.read_text())
    assert record["flags"]["model"] == "mlp" and record["flags"]["global_batch"] == 64
    assert record["effective_seed"] == 7 and record["replicas"] == 1

    record["flags"]["a_flag_from_the_future"] = 1  # unknown keys are ignored
    record["something_else"] = {"x": 1}
    path.write_text(json.dumps(record))
    assert train(config.replace(train_steps=4), **QUIET).start_step == 2  # other flags may change

    with pytest.raises(UserError, match=r"--global_batch=64 -> 32.*--task='classification' -> "):
        train(config.replace(global_batch=32, task="engine.task:Task", train_steps=6), **QUIET)
    assert json.loads(path.read_text())["flags"]["global_batch"] == 64  # the refused run wrote nothing

    allowed = train(config.replace(global_batch=32, allow_config_change=True, train_steps=6), **QUIET)
    assert allowed.start_step == 4 and allowed.final_step == 6
    assert json.loads(path.read_text())["flags"]["global_batch"] == 32  # the record follows the run
