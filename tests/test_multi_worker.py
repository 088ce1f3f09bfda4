"""Real worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy via TF_CONFIG), each bounded
by timeouts: equivalence of worker layouts, agreement, lost workers, the launcher, resume."""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pytest

from helpers import (
    QUIET,
    TASKS_DATA,
    TASKS_FAULTS,
    TASKS_NONFINITE,
    checkpoint_state,
    exported_weights,
    max_difference,
    run_cli,
    small_config,
    small_flags,
    start_workers,
    tensorboard_run,
    tensorboard_scalars,
)
from engine.distribute.launch import worker_tf_configs
from engine.controller.trainer import train
from engine import exit_codes
from engine.update import INITIAL_LOSS_SCALE

pytestmark = pytest.mark.cluster  # several real processes: CI's cluster step

# The run of _single_process_weights (small_config(model="mlp", optimizer="adam")), as flags.
ARGS = small_flags(model="mlp", optimizer="adam", collective_timeout=30)


def _single_process_weights(tmp_path, name, **overrides):
    config = small_config(tmp_path / name, export=True, model="mlp", optimizer="adam", **overrides)
    train(config, **QUIET)
    return exported_weights(tmp_path / name)


def _two_workers(model_dir, *flags):
    """ARGS (with `flags`) on 2 local workers of the launcher, into model_dir."""
    return run_cli(
        "--strategy=multi_worker_mirrored", "--num_workers=2", *ARGS, *flags, f"--model_dir={model_dir}", timeout=180
    )


def _assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("input_mode, accumulate", [("distribute_dataset", 1), ("per_worker", 2), ("resident", 2)])
def test_worker_layouts_train_alike(tmp_path, input_mode, accumulate):
    """2 workers x 1 replica == 1 worker x 2 replicas == 1 worker x 1 replica; the 2 workers also
    with 2 accumulated micro-batches each (their sum is the same update)."""
    launched = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        f"--input_mode={input_mode}",
        f"--grad_accum_steps={accumulate}",
        *ARGS,
        f"--model_dir={tmp_path / 'two_workers'}",
        "--export",
        timeout=180,
    )
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert "[worker 0] global batch 64 = 2 replicas x 32" in launched.stdout
    assert "[worker 1] agreement    all 2 workers run the same flags" in launched.stdout
    two_workers = exported_weights(tmp_path / "two_workers")
    one_by_two = _single_process_weights(
        tmp_path, "one_by_two", strategy="mirrored", cpu_replicas=2, input_mode=input_mode
    )
    one_by_one = _single_process_weights(tmp_path, "one_by_one", input_mode=input_mode)
    _assert_same(two_workers, one_by_one)
    _assert_same(one_by_two, one_by_one)


def test_float16_overflow_on_one_worker_skips_everywhere_without_a_hang(tmp_path):
    """Worker 1's gradients are +Inf at step 3, worker 0's are clean (float16, loss scaling, 2
    micro-batches): both skip that update (the check is on the summed gradients) and finish."""
    launched = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        "--precision=mixed_float16",
        "--grad_accum_steps=2",
        f"--task={TASKS_NONFINITE}:InfGradientTask",
        *ARGS,
        f"--model_dir={tmp_path}",
        timeout=180,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    state = checkpoint_state(tmp_path)
    assert all(np.all(np.isfinite(v)) for v in state.values())
    assert int(state["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 5  # 6 steps, 1 skipped
    assert dict(tensorboard_scalars(tmp_path / "train")["loss_scale"])[3] == INITIAL_LOSS_SCALE / 2


def test_only_the_chief_writes(tmp_path):
    """Every TensorBoard extra on: the chief writes them all (its predict pass for the eval images
    and its profiler add no collective, or the workers would hang); worker 1 writes nothing."""
    extras = ["--histogram_every=3", "--trace_graph", "--profile_steps=0,3"]
    per_worker = [[f"--model_dir={tmp_path / 'chief'}"], [f"--model_dir={tmp_path / 'worker1'}"]]
    with start_workers([*ARGS, *extras], per_worker=per_worker) as cluster:
        codes, outputs = cluster.wait(timeout=120), cluster.outputs
    assert codes == [0, 0], outputs
    assert sorted(os.listdir(tmp_path / "chief")) == ["checkpoints", "config.json", "eval", "export", "train"]
    assert not (tmp_path / "worker1").exists()
    accumulator = tensorboard_run(tmp_path / "chief" / "eval")
    assert {"confusion_matrix", "misclassified", "_hparams_/session_start_info"} <= set(accumulator.Tags()["tensors"])
    assert (tmp_path / "chief" / "train" / "plugins" / "profile").is_dir()


def test_flag_mismatch_stops_every_worker(tmp_path):
    started = time.monotonic()
    with start_workers(
        [*ARGS, f"--model_dir={tmp_path}"], per_worker=[[], ["--global_batch=128", "--model=cnn"]]
    ) as cluster:
        codes, outputs = cluster.wait(timeout=120), cluster.outputs
    assert codes == [2, 2], outputs
    for output in outputs:
        line = [text for text in output.splitlines() if text.startswith("error:")][-1]
        assert "--global_batch differs on worker:1 from worker:0" in line and "--model differs" in line
        assert "Traceback" not in output
    assert not os.path.exists(tmp_path / "checkpoints")
    assert time.monotonic() - started < 60


def test_killed_worker_is_named_within_the_timeout(tmp_path):
    long_run = [*ARGS, "--train_steps=1000000", "--steps_per_loop=5", "--checkpoint_every=5", "--collective_timeout=10"]
    with start_workers([*long_run, f"--model_dir={tmp_path}"]) as cluster:
        cluster.wait_until(lambda: os.path.exists(tmp_path / "checkpoints" / "checkpoint"), timeout=90)
        assert cluster[0].poll() is None, cluster[0].output
        killed_at = time.monotonic()
        cluster[1].kill()
        cluster[0].wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    output = cluster[0].output
    assert cluster[0].returncode == exit_codes.PEER_LOST.code, output[-3000:]
    # The peer watchdog names it after --collective_timeout (10 s) unless the process is inside a
    # call that holds the GIL; then TensorFlow's own heartbeat (20-25 s here) ends the collective.
    assert elapsed < 45, elapsed
    error = [text for text in output.splitlines() if text.startswith("error:")][-1]
    assert "worker:1" in error and "Traceback" not in output


def test_worker_that_never_starts_is_named(tmp_path):
    started = time.monotonic()
    tf_config = worker_tf_configs(2)[0]  # worker 0 of 2; worker 1 never starts
    alone = run_cli(
        "--strategy=multi_worker_mirrored",
        *ARGS,
        "--collective_timeout=5",
        f"--model_dir={tmp_path}",
        env={"TF_CONFIG": tf_config},
        timeout=60,
    )
    assert alone.returncode == exit_codes.CLUSTER_NOT_FORMED.code
    worker1 = json.loads(tf_config)["cluster"]["worker"][1]
    assert f"missing worker(s): worker:1 at {worker1}" in alone.stderr.strip().splitlines()[-1]
    assert time.monotonic() - started < 40


def test_launcher_stops_the_rest_at_the_first_failure_and_never_retries_a_permanent_one(tmp_path):
    started = time.monotonic()
    result = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        *ARGS,
        "--max_restarts=2",
        f"--task={TASKS_FAULTS}:FailOnWorkerOneTask",
        f"--model_dir={tmp_path}",
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-3000:]
    assert "[worker 1] error: FailOnWorkerOneTask: worker 1 fails on purpose" in result.stdout
    assert "launcher: worker 1 exited with code 2; stopping the others" in result.stdout
    # --max_restarts restarts only what a restart may cure (tests/test_restarts.py): a bad Task is not.
    assert result.stdout.count("launching 2 local workers") == 1
    assert "launcher: exit 2 (bad_input, a restart will not help): not restarted" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("launcher: exit 2 (bad_input, a restart will not help); ")
    assert time.monotonic() - started < 30  # well under --collective_timeout=30 plus start-up


def test_multi_worker_run_resumes(tmp_path):
    first = _two_workers(tmp_path / "run", "--train_steps=3")
    assert first.returncode == 0, first.stdout[-3000:]
    second = _two_workers(tmp_path / "run", "--export")
    assert second.returncode == 0, second.stdout[-3000:]
    assert "[worker 0] model_dir" in second.stdout and "(resuming at step 3)" in second.stdout
    assert second.stdout.count("(resuming at step 3)") == 2  # every worker restored
    _assert_same(exported_weights(tmp_path / "run"), _single_process_weights(tmp_path, "straight"))


@pytest.mark.parametrize("shards", [4, 1])  # by FILE, by DATA
def test_two_workers_evaluate_every_streamed_example_once(tmp_path, shards):
    """1,001 test examples in TFRecords, 2 workers: each example counted once (count and id sum)."""
    from helpers import id_shards

    dataset = id_shards(tmp_path / "data", n_train=256, n_test=1001, shards=shards)
    launched = run_cli(
        "--strategy=multi_worker_mirrored",
        "--num_workers=2",
        *ARGS,
        f"--dataset={dataset}",
        f"--task={TASKS_DATA}:IdCountingTask",
        f"--model_dir={tmp_path / 'run'}",
        timeout=180,
    )
    assert launched.returncode == 0, launched.stdout[-3000:]
    policy = "by FILE" if shards == 4 else "by DATA"
    assert f"[worker 0] input        {policy}" in launched.stdout, launched.stdout[-3000:]
    evals = [line.split() for line in launched.stdout.splitlines() if "[worker 0] eval" in line]
    assert evals, launched.stdout[-3000:]
    ids = np.arange(1000, 2001)
    for words in evals:  # [worker 0] eval step N: mean_id X mean_sq Y (1001 examples), counted by the engine
        assert words[-2:] == ["(1001", "examples)"], words
        assert float(words[words.index("mean_id") + 1]) == pytest.approx(ids.mean(), abs=1e-3)
        assert float(words[words.index("mean_sq") + 1]) == pytest.approx(((ids - 1500.0) ** 2).mean(), rel=1e-5)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads in /proc")
def test_long_multi_worker_run_keeps_its_thread_count(tmp_path):
    # TensorFlow arms each collective that has a timeout with a thread sleeping for the whole
    # timeout: with --collective_timeout=300 as a collective option, worker 0 would grow by ~20
    # threads a step, far past the bound below. The engine's collectives carry no timeout.
    args = [
        *ARGS,
        "--train_steps=400",
        "--steps_per_loop=50",
        "--checkpoint_every=400",
        "--summaries=basic",
        "--noexport",
        "--collective_timeout=300",
    ]
    most = 0
    with start_workers([*args, f"--model_dir={tmp_path}"]) as cluster:
        deadline = time.monotonic() + 150
        while cluster[0].poll() is None and time.monotonic() < deadline:
            try:
                most = max(most, _threads(cluster[0].pid))
            except (OSError, StopIteration):
                break
            time.sleep(0.1)
        codes, outputs = cluster.wait(timeout=60), cluster.outputs
    assert codes == [0, 0], outputs[0][-3000:]
    assert "step 400/400" in outputs[0]
    assert 0 < most < 400, most


def test_resume_on_another_worker_count_matches_an_undisturbed_run(tmp_path):
    """2 workers for 2 steps, then 1 process to step 4, then 2 workers to the end (the same
    --global_batch): like 1 replica all along; each resume's banner names the layout change."""
    run = tmp_path / "run"
    first = _two_workers(run, "--train_steps=2")
    assert first.returncode == 0, first.stdout[-3000:]
    out = io.StringIO()
    alone = train(small_config(run, model="mlp", optimizer="adam", collective_timeout=30, train_steps=4), out=out)
    assert alone.start_step == 2 and alone.final_step == 4
    assert "changed      layout 2 workers x 1 replica -> 1 worker x 1 replica at step 2 (" in out.getvalue()
    last = _two_workers(run)
    assert last.returncode == 0, last.stdout[-3000:]
    assert last.stdout.count("(resuming at step 4)") == 2  # every worker restored
    assert "[worker 0] changed      layout 1 worker x 1 replica -> 2 workers x 1 replica at step 4 (" in last.stdout
    straight = small_config(tmp_path / "straight", model="mlp", optimizer="adam", collective_timeout=30)
    train(straight, **QUIET)
    difference = max_difference(checkpoint_state(run), checkpoint_state(tmp_path / "straight"))
    assert difference < 1e-6, difference  # float32 sums in another order
