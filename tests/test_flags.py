"""One home per flag fact: each flag is a Config field (default, type, bounds, help written once in
engine/config.py), `run.py --help` prints engine/exit_codes.py's codes, and the names the flags
accept agree with the registries that build them."""

from __future__ import annotations

import dataclasses
import re

import pytest
from absl import flags as absl_flags
from helpers import run_cli

from engine import exit_codes, optimizers
from engine.config import OPTIMIZERS, Config
from flags.definitions import config_from_flags, define_flags

pytestmark = pytest.mark.fast


def _flag_values(*args) -> absl_flags.FlagValues:
    flag_values = absl_flags.FlagValues()
    define_flags(flag_values)
    flag_values(["run.py", *args])
    return flag_values


def test_every_config_field_is_a_flag_with_the_fields_default():
    flag_values = _flag_values()
    fields = {field.name: field.default for field in dataclasses.fields(Config)}
    flags = {name: flag.default for name, flag in flag_values._flags().items() if name in fields}
    assert flags == fields
    assert set(fields) <= set(flag_values._flags())


def test_the_config_from_default_flags_is_the_default_config():
    built = config_from_flags(_flag_values())
    assert built.replace(model_dir="x") == Config(model_dir="x")
    assert built.model_dir.startswith("runs/mnist-cnn-default-")  # an empty --model_dir names a new run


def test_flags_reach_the_config_with_their_types():
    built = config_from_flags(_flag_values("--seed=3", "--learning_rate=0.5", "--noexport", "--strategy=mirrored"))
    assert (built.seed, built.learning_rate, built.export, built.strategy) == (3, 0.5, False, "mirrored")


def test_help_lists_the_exit_codes_of_the_table():
    proc = run_cli("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    listed = {int(code): name for code, name in re.findall(r"^  (\d+) +(\w+)", text, re.M)}
    assert listed == {c.code: c.name for c in exit_codes.CODES}


def test_help_texts_name_exit_codes_only_as_the_table_does():
    flag_values = _flag_values()
    names = {c.code: c.name for c in exit_codes.CODES}
    for name, flag in flag_values._flags().items():
        for code in re.findall(r"\bexits? (\d+)", flag.help):
            assert re.search(rf"\bexit {code}, {names.get(int(code), '?')}\b", flag.help), (name, flag.help)


def test_the_optimizer_names_are_the_registrys():
    assert tuple(optimizers.OPTIMIZERS) == OPTIMIZERS
