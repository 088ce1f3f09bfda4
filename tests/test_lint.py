"""The code style CI enforces: `ruff check .` and `ruff format --check .` (settings in pyproject.toml).

ruff is pinned in the `test` extra: another release may format differently, so a version change is
its own commit with the reformatted files."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.fast
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_passes(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"ruff {' '.join(command)} failed (run it to fix):\n{proc.stdout}{proc.stderr}"
