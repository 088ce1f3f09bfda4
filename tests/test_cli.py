"""The command line, end to end, no mocks: real `python run.py ...` subprocesses, and run.py's own
main in this process (helpers.run_in_process: absl's flag parsing, then run.main) where a fresh
process proves nothing more; BAD_INPUTS' FRESH_PROCESS cases say why they keep one.

Every training run is tiny (512 synthetic examples, batch 64, 4 steps, the MLP); every bad-input
case must stop before training with exit code 2 (or 1 for absl's own flag errors), no traceback,
and one clear last line on stderr.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import struct

import numpy as np
import pytest

from helpers import TASKS_REFUSED, TINY_FLAGS, explain, run_cli, run_in_process

TINY = TINY_FLAGS
MIRRORED_2 = ("--strategy=mirrored", "--cpu_replicas=2")


def tiny_run(model_dir, *extra, train_steps=4, in_process=False, **kwargs):
    args = (*TINY, *MIRRORED_2, f"--train_steps={train_steps}", f"--model_dir={model_dir}", *extra)
    return run_in_process(*args) if in_process else run_cli(*args, **kwargs)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------
# Data files written by the tests.


def write_idx(path, array, magic=None, truncate_to=None):
    """An IDX file (gzip if `path` ends in .gz): big-endian magic, dims, then uint8 data."""
    array = np.asarray(array, dtype=np.uint8)
    magic = 0x00000800 + array.ndim if magic is None else magic
    payload = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    if truncate_to is not None:
        payload = payload[:truncate_to]
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def tiny_arrays(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), (np.arange(n) % 10).astype(np.uint8)


def write_idx_dir(
    directory,
    n_train=256,
    n_test=70,
    *,
    train_images=None,
    train_labels=None,
    test_labels=None,
    images_magic=None,
    images_truncate_to=None,
):
    os.makedirs(directory, exist_ok=True)
    x_train, y_train = tiny_arrays(n_train, 1)
    x_test, y_test = tiny_arrays(n_test, 2)
    x_train = x_train if train_images is None else train_images
    y_train = y_train if train_labels is None else train_labels
    y_test = y_test if test_labels is None else test_labels
    write_idx(
        os.path.join(directory, "train-images-idx3-ubyte.gz"),
        x_train,
        magic=images_magic,
        truncate_to=images_truncate_to,
    )
    write_idx(os.path.join(directory, "train-labels-idx1-ubyte.gz"), y_train)
    write_idx(os.path.join(directory, "t10k-images-idx3-ubyte.gz"), x_test)
    write_idx(os.path.join(directory, "t10k-labels-idx1-ubyte.gz"), y_test)
    return str(directory)


# ---------------------------------------------------------------------------------------------
# 1, 2. End to end on synthetic data with two CPU replicas, then resume.


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """One 4-step mirrored run, shared (copied before being changed) by the tests below."""
    model_dir = tmp_path_factory.mktemp("cli_run") / "run"
    proc = tiny_run(model_dir)
    return str(model_dir), proc


def copy_run(trained_dir, tmp_path) -> str:
    source, proc = trained_dir
    assert proc.returncode == 0, explain(proc)
    target = str(tmp_path / "run")
    shutil.copytree(source, target)
    return target


def test_end_to_end_mirrored_two_cpu_replicas(trained_dir):
    model_dir, proc = trained_dir
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert any("global batch 64 = 2 replicas x 32" in line for line in lines), proc.stdout
    assert any(line.startswith("done") for line in lines), proc.stdout
    assert any("tensorboard --logdir" in line for line in lines), proc.stdout
    assert os.path.isfile(os.path.join(model_dir, "checkpoints", "ckpt-4.index"))
    assert os.path.isfile(os.path.join(model_dir, "checkpoints", "checkpoint"))
    assert glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))
    assert glob.glob(os.path.join(model_dir, "eval", "events.out.tfevents.*"))
    assert os.path.isfile(os.path.join(model_dir, "export", "model.keras"))


def test_rerun_with_more_steps_resumes(trained_dir, tmp_path):
    model_dir = copy_run(trained_dir, tmp_path)
    proc = tiny_run(model_dir, train_steps=6, in_process=True)
    assert proc.returncode == 0, explain(proc)
    assert "resuming at step 4" in proc.stdout, proc.stdout
    assert "steps 4 -> 6" in proc.stdout, proc.stdout
    assert os.path.isfile(os.path.join(model_dir, "checkpoints", "ckpt-6.index"))


# ---------------------------------------------------------------------------------------------
# 3. Local files: IDX directory and Keras' mnist.npz.


def test_fashion_mnist_from_idx_dir(tmp_path):
    data_dir = write_idx_dir(tmp_path / "idx")
    proc = run_in_process(
        "--dataset=fashion_mnist",
        f"--data_dir={data_dir}",
        "--global_batch=64",
        "--train_steps=2",
        "--steps_per_loop=2",
        "--seed=1",
        "--model=mlp",
        f"--model_dir={tmp_path / 'run'}",
        "--noexport",
    )
    assert proc.returncode == 0, explain(proc)
    assert "256 train / 70 test" in proc.stdout, proc.stdout
    assert any(line.startswith("done") for line in proc.stdout.splitlines()), proc.stdout


def test_mnist_from_npz(tmp_path):
    data_dir = tmp_path / "npz"
    data_dir.mkdir()
    x_train, y_train = tiny_arrays(256, 1)
    x_test, y_test = tiny_arrays(70, 2)
    np.savez(data_dir / "mnist.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    proc = run_in_process(
        "--dataset=mnist",
        f"--data_dir={data_dir}",
        "--global_batch=64",
        "--train_steps=2",
        "--steps_per_loop=2",
        "--seed=1",
        "--model=mlp",
        f"--model_dir={tmp_path / 'run'}",
        "--noexport",
    )
    assert proc.returncode == 0, explain(proc)
    assert "256 train / 70 test" in proc.stdout, proc.stdout
    assert "mnist.npz" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------
# 4. Bad input: non-zero exit, no traceback, one clear last line.


def _idx(**kwargs):
    return lambda tmp: ["--dataset=fashion_mnist", f"--data_dir={write_idx_dir(tmp / 'idx', **kwargs)}"]


def _empty_dir(tmp):
    (tmp / "empty").mkdir()
    return ["--dataset=fashion_mnist", f"--data_dir={tmp / 'empty'}"]


_LABELS_12 = (np.arange(256) % 10).astype(np.uint8)
_LABELS_12[5] = 12


def _not_a_run(tmp):
    (tmp / "run").mkdir()
    (tmp / "run" / "notes.txt").write_text("not a training run\n")
    return ["--mode=eval"]


def _run_of_another_model(tmp):
    """A run record (config.json) of a cnn run; the case evaluates it as an mlp."""
    (tmp / "run").mkdir()
    (tmp / "run" / "config.json").write_text(json.dumps({"flags": {"model": "cnn", "dataset": "synthetic"}}))
    return ["--mode=eval"]


def _model_dir_is_a_file(tmp):
    (tmp / "a_file").write_text("not a directory\n")
    return [f"--model_dir={tmp / 'a_file'}"]


def _empty_npz(tmp):
    (tmp / "npz").mkdir()
    np.savez(tmp / "npz" / "mnist.npz")
    return ["--dataset=mnist", f"--data_dir={tmp / 'npz'}"]


def _npz_wrong_image_rank(tmp):
    (tmp / "npz").mkdir()
    x_train, y_train = tiny_arrays(256, 1)
    x_test, y_test = tiny_arrays(70, 2)
    np.savez(
        tmp / "npz" / "mnist.npz", x_train=x_train.reshape(256, 784), y_train=y_train, x_test=x_test, y_test=y_test
    )
    return ["--dataset=mnist", f"--data_dir={tmp / 'npz'}"]


def _npz(name, **arrays):
    def make(tmp):
        settings = dict(
            x_train=np.zeros((256, 6), np.float32),
            y_train=np.zeros(256, np.int64),
            x_test=np.zeros((10, 6), np.float32),
            y_test=np.zeros(10, np.int64),
        )
        settings.update(arrays)
        np.savez(tmp / name, **{k: v for k, v in settings.items() if v is not None})
        return [f"--dataset=npz:{tmp / name}", "--model=mlp"]

    return make


def _model_file(source):
    def make(tmp):
        (tmp / "models.py").write_text(source)
        return [f"--model={tmp / 'models.py'}:build"]

    return make


def _corrupt_tfrecord(tmp):
    from engine.data import tfrecord

    paths = tfrecord.write_shards(str(tmp / "rec"), "train", np.zeros((300, 4), np.float32), np.zeros(300, np.int64), 2)
    with open(paths[1], "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff\xff")
    return [f"--dataset=tfrecord:{tmp / 'rec'}/train-*", "--model=mlp"]


def _image_folders(tmp, corrupt_body=False):
    for split, n in (("train", 300), ("test", 8)):
        for label in ("a", "b"):
            (tmp / "img" / split / label).mkdir(parents=True)
            for i in range(n // 2):
                (tmp / "img" / split / label / f"{i:03d}.png").write_bytes(_TINY_PNG)
    if corrupt_body:  # valid PNG signatures, then garbage: found only when decoded, in the first batch
        for i in range(1, 150):  # all of class b but its first file (which start-up decodes)
            (tmp / "img" / "train" / "b" / f"{i:03d}.png").write_bytes(_TINY_PNG[:8] + b"garbage" * 20)
    return [f"--dataset=images:{tmp / 'img'}", "--train_steps=10"]


def _no_class_folders(tmp):
    (tmp / "photos").mkdir()
    (tmp / "photos" / "loose.png").write_bytes(_TINY_PNG)
    return [f"--dataset=images:{tmp / 'photos'}"]


_TINY_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d494844520000000200000002080000000057dd52f80000000e"
    "49444154089963606060606000000006000185c299bc0000000049454e44ae426082"
)  # 2x2 grey


def _text(name, content):
    def case(tmp):
        (tmp / name).write_text(content)
        return [f"--dataset=text:{tmp / name}", "--task=language_model"]

    return case


# args (a list, or a function of tmp_path giving one), exit code, keywords in the last line
BAD_INPUTS = [
    pytest.param(["--strategy=nope"], 1, ["strategy"], id="unknown_strategy"),
    pytest.param(["--global_batch=0"], 1, ["global_batch"], id="global_batch_zero"),
    pytest.param(["--cpu_replicas=0"], 1, ["cpu_replicas"], id="cpu_replicas_zero"),
    pytest.param(
        ["--global_batch=64", "--strategy=mirrored", "--cpu_replicas=3"], 2, ["not divisible"], id="batch_not_divisible"
    ),
    pytest.param(lambda tmp: [f"--data_dir={tmp / 'no_such_dir'}"], 2, ["not a directory"], id="missing_data_dir"),
    pytest.param(_empty_dir, 2, ["IDX"], id="empty_idx_dir"),
    pytest.param(_idx(images_truncate_to=16 + 100 * 28 * 28), 2, ["truncated"], id="truncated_idx"),
    pytest.param(_idx(images_magic=0x00000F03), 2, ["magic"], id="bad_magic"),
    pytest.param(_idx(train_labels=_LABELS_12), 2, ["labels"], id="labels_out_of_range"),
    pytest.param(
        _idx(train_labels=(np.arange(250) % 10).astype(np.uint8)), 2, ["256 images", "250 labels"], id="count_mismatch"
    ),
    pytest.param(
        ["--model=nope"],
        2,
        [
            "--model='nope'",
            "cnn_bn",
            "resnet20",
            "package.module:function",
            "path/to/file.py:function",
            "keras.applications.NAME",
        ],
        id="unknown_model",
    ),
    pytest.param(
        _model_file("def build(input_shape, num_classes):\n    return 'a string'\n"),
        2,
        ["models.py:build", "returned str, not a keras.Model"],
        id="model_function_returns_no_model",
    ),
    pytest.param(
        _model_file("def build(input_shape):\n    pass\n"),
        2,
        ["models.py:build", "function(input_shape, num_classes)", "too many positional"],
        id="model_function_wrong_signature",
    ),
    pytest.param(
        ["--model=engine.models.classifiers:nope"],
        2,
        ["classifiers", "no attribute 'nope'"],
        id="model_function_missing",
    ),
    pytest.param(["--model=/no/such/models.py:build"], 2, ["/no/such/models.py"], id="model_file_missing"),
    pytest.param(
        ["--model=keras.applications.ResNet51"],
        2,
        ["ResNet51", "did you mean ResNet50", "MobileNetV2"],
        id="model_application_unknown",
    ),
    pytest.param(
        ["--model=keras.applications.MobileNetV2"],
        2,  # synthetic 28x28 images: too small
        ["MobileNetV2 needs input at least 32x32", "28x28x1"],
        id="model_application_input_too_small",
    ),
    pytest.param(
        lambda tmp: _npz("d.npz")(tmp) + ["--model=keras.applications.ResNet50"],
        2,
        ["ResNet50 takes images", "(6,)"],
        id="model_application_not_images",
    ),
    pytest.param(["--task=nope"], 2, ["--task"], id="unknown_task"),
    pytest.param([f"--task={TASKS_REFUSED}:NotATask"], 2, ["subclass"], id="task_not_a_subclass"),
    pytest.param([f"--task={TASKS_REFUSED}:NoSuchClass"], 2, ["NoSuchClass"], id="task_missing_class"),
    pytest.param(["--task=no_such_module_xyz:Task"], 2, ["no_such_module_xyz"], id="task_missing_module"),
    pytest.param(
        [f"--task={TASKS_REFUSED}:ModelOutsideScopeTask", *MIRRORED_2],
        2,
        ["outside strategy.scope"],
        id="model_outside_scope",
    ),
    pytest.param(["--task=/no/such/file.py:X"], 2, ["/no/such/file.py"], id="task_file_missing"),
    pytest.param(["stray"], 2, ["unexpected", "stray"], id="stray_positional"),
    pytest.param(["--synthetic_train_examples=32"], 2, ["larger than", "32"], id="batch_larger_than_train_set"),
    pytest.param(["--strategy=multi_worker_mirrored"], 2, ["TF_CONFIG"], id="multi_worker_without_tf_config"),
    pytest.param(["--train_steps=-1"], 1, ["train_steps"], id="train_steps_negative"),
    pytest.param(["--steps_per_loop=0"], 1, ["steps_per_loop"], id="steps_per_loop_zero"),
    pytest.param(["--epochs=0"], 1, ["epochs"], id="epochs_zero"),
    pytest.param(["--learning_rate=-0.1"], 1, ["learning_rate"], id="learning_rate_negative"),
    pytest.param(["--learning_rate=nan"], 1, ["learning_rate"], id="learning_rate_nan"),
    pytest.param(["--global_batch=abc"], 1, ["global_batch"], id="global_batch_not_a_number"),
    pytest.param(["--on_nonfinite=ignore"], 1, ["on_nonfinite"], id="on_nonfinite_unknown"),
    pytest.param(["--grad_accum_steps=0"], 1, ["grad_accum_steps"], id="grad_accum_zero"),
    pytest.param(
        ["--global_batch=64", "--grad_accum_steps=3"],
        2,
        ["--global_batch=64", "3 micro-batches"],
        id="grad_accum_uneven",
    ),
    pytest.param(["--lr_schedule=warmup_cosine"], 2, ["--warmup_steps"], id="warmup_without_steps"),
    pytest.param(["--clip_norm=-1"], 1, ["clip_norm"], id="clip_norm_negative"),
    pytest.param(["--weight_decay=nan"], 1, ["weight_decay"], id="weight_decay_nan"),
    pytest.param(["--precision=float8"], 1, ["precision"], id="precision_unknown"),
    pytest.param(
        ["--precision=mixed_float16", f"--task={TASKS_REFUSED}:UnscaledLossTask"],
        2,
        ["self.scale_loss"],
        id="float16_loss_not_scaled",
    ),
    pytest.param(_model_dir_is_a_file, 2, ["a_file", "not a directory"], id="model_dir_is_a_file"),
    pytest.param(
        ["--model_dir=/proc/ctl_engine_run"], 2, ["/proc/ctl_engine_run", "cannot create"], id="model_dir_read_only"
    ),
    pytest.param(
        _idx(test_labels=np.zeros((70, 1, 1), dtype=np.uint8)),
        2,
        ["t10k-labels", "3 dimensions"],
        id="idx_labels_3_dims",
    ),
    pytest.param(_empty_npz, 2, ["mnist.npz", "missing arrays"], id="empty_npz"),
    pytest.param(_npz_wrong_image_rank, 2, ["mnist.npz", "(256, 784)"], id="npz_images_not_2d"),
    # Data sources (tests/test_sources.py checks them in-process too).
    pytest.param(
        lambda tmp: [f"--dataset=tfrecord:{tmp}/none-*.tfrecord"],
        2,
        ["matches no file"],
        id="tfrecord_glob_matches_nothing",
    ),
    pytest.param(
        _corrupt_tfrecord,
        2,
        ["train-00001-of-00002.tfrecord: record 0 (byte 0)", "corrupted record"],
        id="tfrecord_corrupt",
    ),
    pytest.param(
        _npz("d.npz", x_test=np.zeros((10, 7), np.float32)),
        2,
        ["d.npz", "(7,)", "(6,)"],
        id="npz_train_test_shapes_differ",
    ),
    pytest.param(_npz("d.npz", y_test=None), 2, ["d.npz", "missing arrays", "y_test"], id="npz_missing_key"),
    pytest.param(
        lambda tmp: _npz("d.npz", y_train=np.full(256, 7, np.int64))(tmp) + ["--num_classes=5"],
        2,
        ["labels range over [7, 7]", "--num_classes=5"],
        id="label_out_of_range",
    ),
    pytest.param(
        _npz("d.npz", y_train=np.zeros(256, np.float32), y_test=np.zeros(10, np.float32)),
        2,
        ["classifies", "float32"],
        id="float_targets_with_classification",
    ),
    pytest.param(["--dataset=parquet:x"], 2, ["--dataset", "npz:PATH"], id="dataset_kind_unknown"),
    pytest.param(["--synthetic_shape=28,x"], 2, ["--synthetic_shape"], id="synthetic_shape_bad"),
    pytest.param(
        lambda tmp: _image_folders(tmp, corrupt_body=True),
        2,
        ["input pipeline failed after step 0", "train/b/001.png: ", "PNG", "no checkpoint yet"],
        id="images_corrupt_file_mid_training",
    ),
    pytest.param(_no_class_folders, 2, ["class folders"], id="images_dir_without_classes"),
    pytest.param(["--image_size=32,32"], 2, ["--image_size"], id="image_size_on_synthetic"),
    # Evaluation jobs (tests/test_eval_mode.py runs them for real).
    pytest.param(["--mode=predict"], 1, ["mode"], id="mode_unknown"),
    pytest.param(["--mode=eval"], 2, ["is not a training run", "config.json"], id="eval_model_dir_missing"),
    pytest.param(_not_a_run, 2, ["is not a training run"], id="eval_model_dir_not_a_run"),
    pytest.param(
        _run_of_another_model,
        2,
        ["other flags", "--model='mlp' (the run has 'cnn')"],
        id="eval_flags_differ_from_the_run",
    ),
    pytest.param(
        ["--mode=continuous_eval", "--eval_timeout=1"],
        2,
        ["no config.json after 1 s"],
        id="continuous_eval_times_out_before_training",
    ),
    pytest.param(["--eval_timeout=0"], 1, ["eval_timeout"], id="eval_timeout_zero"),
    pytest.param(["--checkpoint=/x/ckpt-3"], 2, ["--checkpoint", "--mode=eval"], id="checkpoint_without_eval_mode"),
    pytest.param(["--evaluator"], 2, ["--evaluator", "--num_workers"], id="evaluator_without_launcher"),
    pytest.param(
        ["--mode=eval", "--strategy=multi_worker_mirrored"],
        2,
        ["--mode=eval", "one process"],
        id="eval_mode_multi_worker",
    ),
    pytest.param(["--best_metric=top5"], 1, ["best_metric"], id="best_metric_without_direction"),
    pytest.param(["--best_metric=+top5"], 2, ["--best_metric=+top5", "no 'top5'"], id="best_metric_unknown"),
    pytest.param(["--eval_every=-2"], 1, ["eval_every"], id="eval_every_below_minus_one"),
    # --dataset=text:PATH and --task=language_model (tests/test_language_model.py).
    pytest.param(
        lambda tmp: [f"--dataset=text:{tmp}/no_such.txt", "--task=language_model"],
        2,
        ["no_such.txt", "no such file"],
        id="text_file_missing",
    ),
    pytest.param(_text("empty.txt", ""), 2, ["empty.txt", "empty"], id="text_file_empty"),
    pytest.param(
        lambda tmp: _text("short.txt", "a short text. " * 10)(tmp) + ["--seq_len=200"],
        2,
        ["140 bytes", "--seq_len=200", "too large"],
        id="text_seq_len_too_large",
    ),
    pytest.param(["--seq_len=0"], 1, ["seq_len"], id="seq_len_zero"),
    pytest.param(["--task=language_model"], 2, ["token sequences", "text:PATH"], id="language_model_on_images"),
    pytest.param(
        lambda tmp: _text("t.txt", "some text. " * 200)(tmp) + ["--seq_len=8", "--grad_accum_steps=2"],
        2,
        ["all-reduces", "--grad_accum_steps=2"],
        id="language_model_grad_accum",
    ),
    pytest.param(
        lambda tmp: _text("t.txt", "some text. " * 200)(tmp) + ["--seq_len=8", "--jit_compile"],
        2,
        ["all-reduces", "--jit_compile=True"],
        id="language_model_jit_compile",
    ),
]


# The cases that still start run.py as a subprocess, and why: the process boundary itself (absl's
# app.run, the exit status, run.py's entry point), or what one test process cannot redo.
FRESH_PROCESS = {
    "unknown_strategy": "an absl flag error through app.run: exit status 1 of a real process",
    "stray_positional": "an engine error through app.run and entry_point: exit status 2 of a real process",
    "batch_not_divisible": "--cpu_replicas=3: this process's TensorFlow already has conftest.py's 2 CPU devices",
}


def _files_under(directory) -> dict:
    """{relative path: bytes} of every file below `directory`."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


@pytest.mark.parametrize("args, exit_code, keywords", BAD_INPUTS)
def test_bad_input_fails_with_one_clear_line(request, tmp_path, args, exit_code, keywords):
    args = args(tmp_path) if callable(args) else args
    fresh = request.node.callspec.id in FRESH_PROCESS
    before = _files_under(tmp_path)  # what the case wrote (data files, a file as model_dir): kept as is
    # Defaults: a tiny synthetic run; the case's own flags come last and win.
    base = [*TINY, "--train_steps=4", f"--model_dir={tmp_path / 'run'}"]
    proc = run_cli(*base, *args, timeout=120) if fresh else run_in_process(*base, *args)
    after = _files_under(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "a file of the case was changed"
    assert proc.returncode == exit_code, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    if exit_code == 1:  # absl's flag error: "FATAL Flags parsing error: flag --x=...: why"
        fatal = [line for line in proc.stderr.splitlines() if "FATAL Flags parsing error" in line]
        assert len(fatal) == 1, explain(proc)
        line = fatal[0]
    else:
        line = last_line(proc.stderr)
        assert line.startswith("error: "), explain(proc)
    for keyword in keywords:
        assert keyword in line, explain(proc)
    assert not any(line.startswith("done") for line in proc.stdout.splitlines()), "trained before failing"
    assert not os.path.exists(tmp_path / "run" / "checkpoints"), "wrote checkpoints before failing"


def test_in_process_runs_leave_no_flag_behind(tmp_path):
    """run_in_process resets absl's FLAGS: a flag one case set is back at its default for the next
    (else --checkpoint, checked first, would stop the second run with its own error)."""
    from absl import flags as absl_flags
    from absl import logging as absl_logging

    verbosity = absl_logging.get_verbosity()
    base = [*TINY, f"--model_dir={tmp_path / 'run'}"]
    first = run_in_process(*base, "--mode=eval", "--checkpoint=/x/ckpt-3", "--verbosity=1")
    assert first.returncode == 2 and "is not a training run" in last_line(first.stderr), explain(first)
    second = run_in_process(*base, "--evaluator")
    assert second.returncode == 2, explain(second)
    assert "--evaluator needs" in last_line(second.stderr) and "--checkpoint" not in second.stderr, explain(second)
    assert not absl_flags.FLAGS.is_parsed() and absl_flags.FLAGS["checkpoint"].value == ""
    assert absl_logging.get_verbosity() == verbosity


def test_mnist_without_local_files_or_network(tmp_path):
    """No --data_dir, an empty Keras cache: Keras' download fails offline -> one clear line. The
    download goes through a proxy on a closed local port, so the machine is offline for it even
    where it has internet."""
    keras_home = tmp_path / "keras_home"
    keras_home.mkdir()
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens
    offline = {name: closed for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    proc = run_cli(
        "--dataset=mnist",
        "--global_batch=64",
        "--train_steps=2",
        "--model=mlp",
        f"--model_dir={tmp_path / 'run'}",
        timeout=120,
        env={"KERAS_HOME": str(keras_home), "NO_PROXY": "", "no_proxy": "", **offline},
    )
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    line = last_line(proc.stderr)
    assert line.startswith("error: "), explain(proc)
    assert "mnist.npz" in line and "fashion_mnist" in line, explain(proc)


# ---------------------------------------------------------------------------------------------
# 5. --help shows the engine's flags (not hidden under --helpfull).


@pytest.fixture(scope="module")
def help_run():
    return run_cli("--help", timeout=120)


@pytest.mark.fast
def test_help_lists_the_engine_flags(help_run):
    output = help_run.stdout + help_run.stderr
    assert "Traceback" not in output, explain(help_run)
    for flag in (
        "--strategy",
        "--global_batch",
        "--cpu_replicas",
        "--model_dir",
        "--steps_per_loop",
        "--dataset",
        "--data_dir",
        "--task",
        "--train_steps",
    ):
        assert flag in help_run.stdout, f"{flag} missing from --help:\n{explain(help_run)}"


@pytest.mark.fast
def test_help_lists_the_three_model_forms(help_run):
    text = " ".join(help_run.stdout.split())  # absl wraps the help text
    for form in ("resnet20", "package.module:function", "path/to/file.py:function", "keras.applications.NAME"):
        assert form in text, f"{form} missing from --model's help:\n{explain(help_run)}"


@pytest.mark.fast
def test_help_exits_zero(help_run):
    assert help_run.returncode == 0, explain(help_run)


# ---------------------------------------------------------------------------------------------
# 6. A checkpoint that cannot be restored stops the run (no silent fresh start or partial restore).


def _resume_cases(trained_dir, base):
    """{case: (model_dir, CompletedProcess, files before)} for each resume that must not start."""
    cases = {}

    def resume(case, model_dir, *extra):
        before = _files_under(os.path.join(model_dir, "checkpoints"))
        in_process = case not in RESUME_IN_A_FRESH_PROCESS
        cases[case] = (model_dir, tiny_run(model_dir, *extra, train_steps=6, in_process=in_process), before)

    # Garbage in the .index file.
    model_dir = copy_run(trained_dir, base / "corrupt")
    with open(os.path.join(model_dir, "checkpoints", "ckpt-4.index"), "wb") as f:
        f.write(b"this is not a checkpoint index" * 10)
    resume("corrupt_index", model_dir)
    # An mlp checkpoint resumed as a cnn, the config change allowed: the checkpoint still refuses.
    resume("mlp_to_cnn", copy_run(trained_dir, base / "mlp_to_cnn"), "--model=cnn", "--allow_config_change")
    # A cnn checkpoint resumed as an mlp, idem.
    model_dir = str(base / "cnn_to_mlp" / "run")
    first = tiny_run(model_dir, "--model=cnn", train_steps=2, in_process=True)
    assert first.returncode == 0, explain(first)
    resume("cnn_to_mlp", model_dir, "--model=mlp", "--allow_config_change")
    # config.json: another model or global batch without --allow_config_change; a corrupt record.
    resume("config_change_model", copy_run(trained_dir, base / "change_model"), "--model=cnn")
    resume("config_change_global_batch", copy_run(trained_dir, base / "change_batch"), "--global_batch=32")
    model_dir = copy_run(trained_dir, base / "corrupt_config")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        f.write("{not json")
    resume("corrupt_config_json", model_dir)
    return cases


# A failed restore in a real process: TensorFlow's clean-up warnings at its exit (after main
# returned) must still come before the error line, which only a process's own end shows.
RESUME_IN_A_FRESH_PROCESS = {"mlp_to_cnn"}


@pytest.fixture(scope="module")
def bad_resumes(trained_dir, tmp_path_factory):
    return _resume_cases(trained_dir, tmp_path_factory.mktemp("bad_resume"))


# case -> keywords of its error line
RESUME_CASES = {
    "corrupt_index": ["checkpoint", "ckpt-4"],
    "mlp_to_cnn": ["checkpoint", "does not match"],
    "cnn_to_mlp": ["checkpoint", "does not match"],
    "config_change_model": ["--model='mlp' -> 'cnn'", "config.json", "--allow_config_change"],
    "config_change_global_batch": ["--global_batch=64 -> 32", "config.json", "--allow_config_change"],
    "corrupt_config_json": ["config.json", "cannot read"],
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_unresumable_run_stops_and_changes_nothing(bad_resumes, case):
    model_dir, proc, before = bad_resumes[case]
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, explain(proc)
    assert errors[0] == last_line(proc.stderr), "the error is not the last line:\n" + explain(proc)
    for keyword in RESUME_CASES[case]:
        assert keyword in errors[0], explain(proc)
    assert not any(line.startswith("done") for line in proc.stdout.splitlines()), explain(proc)
    assert _files_under(os.path.join(model_dir, "checkpoints")) == before, "checkpoints changed"
