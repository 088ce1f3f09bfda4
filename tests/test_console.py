"""A quiet console: TensorFlow's C++ start-up lines appear at most once, and its INFO lines only
when --verbosity asks for them (engine/observe/startup_noise.py)."""

from __future__ import annotations

import pytest

from engine.observe.startup_noise import kept_lines
from helpers import explain, run_cli

CAPTURED = """WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796411445.967368   10427 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1796411445.967823   10427 cudart_stub.cc:31] Could not find cuda drivers on your machine.
W0000 00:00:1796411446.000001   10427 something.cc:12] a real warning
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796411448.486513   10427 port.cc:153] oneDNN custom operations are on.
W0000 00:00:1796411448.500001   10427 something.cc:12] a real warning
"""


@pytest.mark.fast
def test_info_lines_hidden_and_every_line_once():
    assert kept_lines(CAPTURED) == ["W0000 00:00:1796411446.000001   10427 something.cc:12] a real warning"]


@pytest.mark.fast
def test_with_info_every_distinct_line_once():
    kept = kept_lines(CAPTURED, show_info=True)
    assert len(kept) == 4 and sum("port.cc" in line for line in kept) == 1
    assert kept[0].startswith("WARNING: All log messages")


def _noise(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("I0000") or "absl::InitializeLog" in line]


@pytest.mark.parametrize("verbosity, shown", [(None, False), ("--verbosity=0", True)])
def test_a_run_shows_cpp_info_lines_only_when_asked(tmp_path, verbosity, shown):
    args = [
        "--dataset=synthetic",
        "--synthetic_train_examples=256",
        "--synthetic_test_examples=64",
        "--global_batch=64",
        "--train_steps=2",
        "--model=mlp",
        "--noexport",
        f"--model_dir={tmp_path}",
    ]
    proc = run_cli(*args, *([verbosity] if verbosity else []), env={"TF_CPP_MIN_LOG_LEVEL": ""})
    assert proc.returncode == 0, explain(proc)
    noise = _noise(proc.stderr)
    if shown:
        assert noise and len(noise) == len({line.split("] ", 1)[-1] for line in noise}), noise  # each once
    else:
        assert noise == [], noise
