"""Two real worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy via TF_CONFIG)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import REPO, exported_weights, small_config
from engine.trainer import train

ARGS = ["--dataset=synthetic", "--synthetic_train_examples=1024", "--synthetic_test_examples=300",
        "--global_batch=64", "--train_steps=6", "--steps_per_loop=3", "--seed=7", "--model=cnn",
        "--optimizer=adam", "--collective_timeout=60"]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start_workers(model_dirs, extra_args=()):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in _free_ports(len(model_dirs))]}
    processes = []
    for index, model_dir in enumerate(model_dirs):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env = dict(os.environ, TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="3")
        processes.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "run.py"), "--strategy=multi_worker_mirrored",
             f"--model_dir={model_dir}", *ARGS, *extra_args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=180)[0])
    finally:
        for process in processes:
            process.kill()
    return [p.returncode for p in processes], outputs


def test_two_workers_match_one_replica_and_only_the_chief_writes(tmp_path):
    codes, outputs = _start_workers([tmp_path / "chief", tmp_path / "worker1"])
    assert codes == [0, 0], outputs
    assert "global batch 64 = 2 replicas x 32" in outputs[0]
    assert sorted(os.listdir(tmp_path / "chief")) == ["checkpoints", "config.json", "eval", "export", "train"]
    assert not (tmp_path / "worker1").exists()  # the other worker wrote nothing of its own

    train(small_config(tmp_path / "single", export=True, model="cnn", optimizer="adam"),
          out=open(os.devnull, "w"))
    for a, b in zip(exported_weights(tmp_path / "chief"), exported_weights(tmp_path / "single")):
        np.testing.assert_allclose(a, b, atol=1e-5)
