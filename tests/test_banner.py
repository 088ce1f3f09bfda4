"""The banner says what the run is about to do where it matters before training: here, precision
that does not fit the machine."""

from __future__ import annotations

from helpers import explain, run_cli

SMALL = (
    "--dataset=synthetic",
    "--synthetic_train_examples=256",
    "--synthetic_test_examples=64",
    "--model=mlp",
    "--train_steps=2",
    "--global_batch=32",
    "--noexport",
)


def test_mixed_float16_on_a_cpu_is_named_with_the_fast_alternative(tmp_path):
    proc = run_cli(*SMALL, "--precision=mixed_float16", f"--model_dir={tmp_path / 'run'}", timeout=180)
    assert proc.returncode == 0, explain(proc)
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note") and "mixed_float16" in line]
    assert len(notes) == 1 and "--precision=mixed_bfloat16" in notes[0], explain(proc)
