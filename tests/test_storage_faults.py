"""Storage faults end in one line (issue 46 item 4): a full disk during a checkpoint save and a
read-only --model_dir of an existing run each stop with exit 3 (storage_failed) and one line naming
what failed where and the intact checkpoint; the partial ckpt-N_temp is removed.

Real processes on real filesystems where the machine allows it: a small tmpfs (really full) and a
read-only bind mount, each in a mount namespace of its own (`unshare --mount` as root, a user
namespace otherwise), so nothing outside the test sees them. Where no namespace may mount, the
closest real conditions: a file-size limit (RLIMIT_FSIZE: the save's write fails with EFBIG) and,
for read-only, `chmod` (as a user other than root) or, as root (whom chmod does not stop), a file
where the event files' directory should be.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf
from helpers import REPO, TINY_FLAGS, small_config

from engine.controller import checkpoints, trainer
from engine.errors import StorageFailed

FLAGS = (*TINY_FLAGS, "--noexport", "--eval_every=-1", "--checkpoint_every=2")
# --nopreflight: its trial checkpoint would meet the full disk first (docs/failures.md#the-preflight);
# these runs check the failure of the real save.
RUN = [sys.executable, os.path.join(REPO, "run.py"), *FLAGS, "--nopreflight"]
TIMEOUT = 240

# Inside a mount namespace: a 3 MiB tmpfs, a run of 4 steps (ckpt-2, ckpt-4: about 1.2 MiB), the disk
# filled to 128 KiB short (the event files and the record still fit, a checkpoint does not), the
# resumed run; its checkpoints copied out; then the run's directory mounted read-only and resumed.
SCRIPT = r"""
set -u
M=$1; LOGS=$2; shift 2
mount -t tmpfs -o size=3m tmpfs "$M" || exit 90
D=$M/run
"$@" --train_steps=4 --model_dir=$D > $LOGS/first.out 2> $LOGS/first.err || exit 91
dd if=/dev/zero of=$M/filler bs=4k 2>/dev/null; truncate -s -128K $M/filler
"$@" --train_steps=8 --model_dir=$D > $LOGS/full.out 2> $LOGS/full.err; echo $? > $LOGS/full.rc
cp -r $D/checkpoints $LOGS/kept
rm $M/filler
mount --bind $D $D && mount -o remount,ro,bind $D || exit 92
"$@" --train_steps=8 --model_dir=$D > $LOGS/ro.out 2> $LOGS/ro.err; echo $? > $LOGS/ro.rc
"""


def _namespace(tmp_path) -> list | None:
    """The command prefix of a mount namespace this process may mount in, or None."""
    if not shutil.which("unshare"):
        return None
    probe = tmp_path / "probe"
    probe.mkdir()
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        try:
            done = subprocess.run(
                [*prefix, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"], capture_output=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return None


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], stderr[-3000:]
    return errors[0]


def _faults(tmp_path) -> dict:
    """{case: (exit code, stderr)} for "full" and "read_only", plus the checkpoints after "full"."""
    logs = tmp_path / "logs"
    logs.mkdir()
    prefix = _namespace(tmp_path)
    if prefix is not None:
        mount = tmp_path / "mount"
        mount.mkdir()
        done = subprocess.run(
            [*prefix, "bash", "-c", SCRIPT, "script", str(mount), str(logs), *RUN],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=3 * TIMEOUT,
        )
        assert done.returncode == 0, f"{done.returncode}\n{done.stderr}\n" + "".join(
            p.read_text()[-2000:] for p in logs.glob("first.*")
        )
        read = {
            case: (int((logs / f"{case}.rc").read_text()), (logs / f"{case}.err").read_text())
            for case in ("full", "ro")
        }
        return {"full": read["full"], "read_only": read["ro"], "kept": logs / "kept", "how": "tmpfs"}
    # No namespace may mount here: the closest real conditions (see the module's docstring).
    model_dir = tmp_path / "run"
    first = subprocess.run([*RUN, "--train_steps=4", f"--model_dir={model_dir}"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # a checkpoint's data is larger

    full = subprocess.run(
        [*RUN, "--train_steps=8", f"--model_dir={model_dir}"],
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=TIMEOUT,
    )
    shutil.copytree(model_dir / "checkpoints", logs / "kept")
    if os.geteuid() != 0:
        for root, dirs, files in os.walk(model_dir):
            for name in dirs + files:
                os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
        os.chmod(model_dir, 0o555)
    else:
        shutil.rmtree(model_dir / "train")
        (model_dir / "train").write_text("a file where the event files' directory should be")
    read_only = subprocess.run(
        [*RUN, "--train_steps=8", f"--model_dir={model_dir}"], capture_output=True, text=True, timeout=TIMEOUT
    )
    os.chmod(model_dir, 0o755)
    return {
        "full": (full.returncode, full.stderr),
        "read_only": (read_only.returncode, read_only.stderr),
        "kept": logs / "kept",
        "how": "limits",
    }


def test_a_full_disk_and_a_read_only_model_dir_end_in_one_line_with_the_checkpoint_intact(tmp_path):
    faults = _faults(tmp_path)
    code, stderr = faults["full"]
    assert code == 3, stderr[-3000:]
    line = _one_line(stderr)
    assert line.startswith("error: saving checkpoint ckpt-6 into "), line
    assert ("No space left on device" if faults["how"] == "tmpfs" else "File too large") in line, line
    assert "removed the partial ckpt-6_temp" in line and "checkpoints/ckpt-4 is intact" in line, line
    kept = sorted(os.listdir(faults["kept"]))
    assert not [name for name in kept if name.startswith("ckpt-6")], kept  # nothing partial left
    assert checkpoints.unreadable(str(faults["kept"] / "ckpt-4")) is None  # the previous one reads back whole

    code, stderr = faults["read_only"]
    assert code == 3, stderr[-3000:]
    line = _one_line(stderr)
    assert "checkpoints/ckpt-4 is intact" in line and "make it writable" in line, line
    if faults["how"] == "tmpfs":
        assert "Read-only file system" in line, line


@pytest.mark.fast
def test_a_failed_write_under_the_run_is_named_and_other_errors_are_not(tmp_path):
    config = small_config(tmp_path)
    events = os.path.join(str(tmp_path), "train", "events.out.tfevents.1.host.2.v2")
    full = tf.errors.ResourceExhaustedError(None, None, f"{events}; No space left on device\n\tCould not flush")
    failure = trainer._write_failure(full, config)
    assert isinstance(failure, StorageFailed) and failure.exit_code == 3
    assert str(failure).startswith(f"writing the TensorBoard event file {events} failed (No space left on device)")
    assert "no checkpoint was written before" in str(failure)
    # A data file outside the run that cannot be read, and an error that is no storage fault: not named.
    elsewhere = PermissionError(13, "Permission denied", "/data/train.npz")
    assert trainer._write_failure(elsewhere, config) is None
    assert trainer._write_failure(tf.errors.InvalidArgumentError(None, None, f"{events}: bad shape"), config) is None
