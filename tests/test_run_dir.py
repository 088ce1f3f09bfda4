"""A run directory is only as safe as its newest file (issue 46, invariant 14).

Real runs on real files (run.py's main, in this process where a fresh one proves nothing more; the
references, the lock's holders and the SIGKILLed run are processes of their own): a damaged newest
checkpoint (its .index deleted, all its files deleted, its data truncated) or a bad `checkpoint`
state file (garbage, empty) resumes from the newest checkpoint that reads back whole, bitwise equal
to an undisturbed run, with the damaged files set aside in checkpoints/damaged/ and named in one
line; no readable checkpoint at all is a one-line refusal that moves nothing; the evaluator skips a
damaged checkpoint and moves nothing. One training run per --model_dir: a second one is refused
naming the first, a SIGKILLed run's lock is taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import REPO, TINY_FLAGS, checkpoint_state, explain, run_cli, run_in_process

from engine.controller import checkpoints, run_lock
from engine.errors import UserError

# One replica, deterministic: a resume is bitwise equal to an undisturbed run. 512 / 64 = 8 steps
# per epoch, so the resumed steps 7..10 cross into a reshuffled second epoch.
BASE = (
    *TINY_FLAGS,
    "--strategy=default",
    "--deterministic",
    "--checkpoint_every=2",
    "--keep_checkpoints=5",
    "--eval_every=-1",
)
WAITING_TASK = f"--task={os.path.join(REPO, 'tests', 'tasks_rundir.py')}:WaitingTask"
GO_FILE_ENV = "CTL_TEST_GO_FILE"
TIMEOUT = 300


def _command(*args):
    return [sys.executable, os.path.join(REPO, "run.py"), *BASE, *args]


def _start(*args, env=None):
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    return subprocess.Popen(
        _command(*args), cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(processes: dict) -> dict:
    """{name: CompletedProcess} of Popens started together; every one is killed at the end."""
    done = {}
    try:
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=TIMEOUT)
            done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    return done


def _ckpt_dir(model_dir) -> str:
    return os.path.join(str(model_dir), "checkpoints")


def _files_under(directory) -> dict:
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return found


def _delete_index(d):
    os.remove(os.path.join(d, "ckpt-8.index"))


def _delete_all(d):
    for name in os.listdir(d):
        if name.startswith("ckpt-8."):
            os.remove(os.path.join(d, name))


def _truncate_data(d):
    path = os.path.join(d, "ckpt-8.data-00000-of-00001")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garbage_state(d):
    with open(os.path.join(d, "checkpoint"), "w") as f:
        f.write("this is {not a state file\n")


def _empty_state(d):
    open(os.path.join(d, "checkpoint"), "w").close()


# case -> (damage, the step resumed from, words of its "damaged" line or None, files set aside)
CASES = {
    "index_deleted": (
        _delete_index,
        6,
        ["ckpt-8", ".index file is missing", "moved to"],
        ["ckpt-8.data-00000-of-00001"],
    ),
    "all_files_deleted": (_delete_all, 6, ["ckpt-8", "none of its files exist", "skipped"], []),
    "data_truncated": (
        _truncate_data,
        6,
        ["ckpt-8", "reading it failed", "moved to"],
        ["ckpt-8.data-00000-of-00001", "ckpt-8.index"],
    ),
    "garbage_state_file": (_garbage_state, 8, None, []),
    "empty_state_file": (_empty_state, 8, None, []),
}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """(an 8-step run with ckpt-2..8, an undisturbed 10-step run's final checkpoint state)."""
    root = tmp_path_factory.mktemp("run_dir")
    done = _finish(
        {
            "base": _start("--train_steps=8", f"--model_dir={root / 'base'}"),
            "straight": _start("--train_steps=10", f"--model_dir={root / 'straight'}"),
        }
    )
    for proc in done.values():
        assert proc.returncode == 0, explain(proc)
    return str(root / "base"), checkpoint_state(root / "straight")


@pytest.fixture(scope="module")
def damaged_resumes(base_run, tmp_path_factory):
    """{case: (model_dir, the resumed run's CompletedProcess)}: every case resumed to step 10, in
    this process one after another (the undisturbed reference is a fresh process's)."""
    base, _ = base_run
    root = tmp_path_factory.mktemp("damaged")
    done = {}
    for case, (damage, _, _, _) in CASES.items():
        model_dir = str(root / case)
        shutil.copytree(base, model_dir)
        damage(_ckpt_dir(model_dir))
        done[case] = (model_dir, run_in_process(*BASE, "--train_steps=10", f"--model_dir={model_dir}"))
    return done


@pytest.mark.parametrize("case", CASES)
def test_damage_resumes_from_the_newest_intact_checkpoint(base_run, damaged_resumes, case):
    _, straight = base_run
    model_dir, proc = damaged_resumes[case]
    _, resumed_from, words, set_aside = CASES[case]
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, explain(proc)
    assert f"(resuming at step {resumed_from})" in proc.stdout, explain(proc)
    damaged_lines = [line for line in proc.stdout.splitlines() if line.startswith("damaged ")]
    if words is None:
        assert not damaged_lines, explain(proc)
        assert any(line.startswith("checkpoints  rewrote") for line in proc.stdout.splitlines()), explain(proc)
    else:
        assert len(damaged_lines) == 1, explain(proc)
        for word in words:
            assert word in damaged_lines[0], explain(proc)
        assert f"resuming from ckpt-{resumed_from}" in damaged_lines[0], explain(proc)
    damaged_dir = os.path.join(_ckpt_dir(model_dir), "damaged")
    assert sorted(os.listdir(damaged_dir) if os.path.isdir(damaged_dir) else []) == set_aside
    for step in (2, 4, 6, 8, 10):  # the older intact ones kept; 8 and 10 saved again by the resumed run
        assert os.path.isfile(os.path.join(_ckpt_dir(model_dir), f"ckpt-{step}.index")), step
    assert tf.train.latest_checkpoint(_ckpt_dir(model_dir)).endswith("ckpt-10")
    resumed = checkpoint_state(model_dir)
    assert sorted(resumed) == sorted(straight)
    different = [name for name in resumed if not np.array_equal(resumed[name], straight[name])]
    assert not different, f"the resumed run differs from the undisturbed one in {different}"


def test_no_readable_checkpoint_is_refused_in_one_line_and_nothing_moves(base_run, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(base_run[0], model_dir)
    for step in (2, 4, 6, 8):
        with open(os.path.join(_ckpt_dir(model_dir), f"ckpt-{step}.index"), "wb") as f:
            f.write(b"not an index" * 10)
    before = _files_under(model_dir)
    proc = run_in_process(*BASE, "--train_steps=10", f"--model_dir={model_dir}")
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], explain(proc)
    for word in ("reads back whole", "ckpt-8", "ckpt-2", "nothing was moved", "damaged"):
        assert word in errors[0], explain(proc)
    assert _files_under(model_dir) == before


def test_evaluator_skips_a_damaged_checkpoint_and_moves_nothing(base_run, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(base_run[0], model_dir)
    _truncate_data(_ckpt_dir(model_dir))
    before = _files_under(model_dir + "/checkpoints")
    proc = run_in_process(*BASE, "--mode=eval", f"--model_dir={model_dir}")
    assert proc.returncode == 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    warnings = [line for line in proc.stdout.splitlines() if "cannot be read back" in line]
    assert len(warnings) == 1 and "ckpt-8" in warnings[0] and "skipped" in warnings[0], explain(proc)
    assert "[ckpt-6]" in proc.stdout, explain(proc)
    assert _files_under(model_dir + "/checkpoints") == before


def _wait_for_lock(model_dir, process):
    """The lock file's holder once `process` wrote it (the process waits in WaitingTask)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            with open(run_lock.path(model_dir)) as f:
                holder = json.loads(f.read() or "null")
        except (FileNotFoundError, ValueError):
            holder = None
        if holder and holder.get("pid") == process.pid:
            return holder
        time.sleep(0.2)
    raise AssertionError("the first run never took the lock")


def test_a_second_run_in_the_same_directory_is_refused_and_the_first_finishes(tmp_path):
    model_dir, go = str(tmp_path / "run"), tmp_path / "go"
    first = _start("--train_steps=4", f"--model_dir={model_dir}", WAITING_TASK, env={GO_FILE_ENV: str(go)})
    try:
        _wait_for_lock(model_dir, first)
        second = run_cli(*BASE, "--train_steps=4", f"--model_dir={model_dir}", timeout=TIMEOUT)
    finally:
        go.touch()
    done = _finish({"first": first})["first"]
    assert second.returncode == 2, explain(second)
    assert "Traceback" not in second.stderr, explain(second)
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "in use by another training run" in last, explain(second)
    assert f"pid {first.pid}" in last and run_lock.path(model_dir) in last, explain(second)
    assert done.returncode == 0, explain(done)
    assert any(line.startswith("done") for line in done.stdout.splitlines()), explain(done)
    assert not os.path.exists(run_lock.path(model_dir)), "the lock outlived its run"


def test_a_sigkilled_runs_directory_resumes_without_a_lock_complaint(base_run, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(base_run[0], model_dir)
    killed = _start(
        "--train_steps=10",
        f"--model_dir={model_dir}",
        WAITING_TASK,
        "--allow_config_change",
        env={GO_FILE_ENV: str(tmp_path / "never")},
    )
    try:
        _wait_for_lock(model_dir, killed)
    finally:
        killed.kill()
        killed.communicate(timeout=60)
    assert os.path.exists(run_lock.path(model_dir))  # left behind by the killed process
    proc = run_cli(*BASE, "--train_steps=10", f"--model_dir={model_dir}", timeout=TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    assert "error" not in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    assert "(resuming at step 8)" in proc.stdout, explain(proc)
    took_over = [line for line in proc.stdout.splitlines() if line.startswith("lock ")]
    assert len(took_over) == 1 and f"pid {killed.pid}" in took_over[0], explain(proc)
    assert not os.path.exists(run_lock.path(model_dir))


# In-process checks of the pieces (fast) --------------------------------------------------------


@pytest.mark.fast
def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    model_dir = str(tmp_path / "run")
    first = run_lock.RunLock(model_dir)
    assert first.acquire() is None
    with pytest.raises(UserError, match=rf"in use by another training run \(host .*, pid {os.getpid()},"):
        run_lock.RunLock(model_dir).acquire()
    first.release()
    assert not os.path.exists(run_lock.path(model_dir))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(run_lock.path(model_dir), "w") as f:  # what a killed run leaves: a file, no flock
        json.dump({"host": os.uname().nodename, "pid": int(dead.stdout), "started": "then"}, f)
    second = run_lock.RunLock(model_dir)
    line = second.acquire()
    assert line and f"pid {int(dead.stdout)}" in line and "no longer holds it" in line
    second.release()


@pytest.mark.fast
def test_lock_refuses_a_live_process_named_in_the_file_even_without_a_flock(tmp_path):
    """A filesystem that ignores flock: the file naming a live process of this host still refuses."""
    model_dir = str(tmp_path / "run")
    os.makedirs(model_dir)
    with open(run_lock.path(model_dir), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": os.getppid(), "started": "now"}, f)
    with pytest.raises(UserError, match=rf"pid {os.getppid()},"):
        run_lock.RunLock(model_dir).acquire()


@pytest.mark.fast
def test_checkpoints_are_found_from_the_files_and_checked_whole(tmp_path):
    directory = str(tmp_path / "checkpoints")
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(tf.ones([256]))), directory, 5)
    for step in (1, 2, 3):
        manager.save(checkpoint_number=step)
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write("garbage")
    assert [step for step, _ in checkpoints.found_checkpoints(directory)] == [3, 2, 1]
    assert checkpoints.unreadable(os.path.join(directory, "ckpt-3")) is None
    data = os.path.join(directory, "ckpt-3.data-00000-of-00001")
    contents = bytearray(open(data, "rb").read())
    contents[40] ^= 0xFF  # one flipped byte: the tensor's checksum fails
    open(data, "wb").write(bytes(contents))
    assert "reading it failed" in checkpoints.unreadable(os.path.join(directory, "ckpt-3"))
    os.remove(os.path.join(directory, "ckpt-2.index"))
    assert checkpoints.unreadable(os.path.join(directory, "ckpt-2")) == "its .index file is missing"
    assert checkpoints.unreadable(os.path.join(directory, "ckpt-9")) == "none of its files exist"
