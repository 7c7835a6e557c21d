"""Multi-host training: 2 processes x 4 CPU devices on localhost equal 1 process x 8 devices.

Two processes of tests/multihost_worker.py join through ``jax.distributed.initialize``
(127.0.0.1, a free port) and run 5 steps of examples/train.py on a dp=2, cp=2, tp=2 mesh that
spans both; the same run in this process (8 devices, tests/conftest.py) is the reference. The
per-step losses must agree (the programs are the same; only the collectives' transport differs).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 300
TRAIN_ARGS = ["--model", "glm5-tiny", "--steps", "5", "--dense-warmup-steps", "0",
              "--batch", "4", "--seq-len", "128", "--corpus-mb", "0.25", "--eval-batches", "1",
              "--eval-every", "0", "--no-progress", "--mesh", "dp=2,cp=2,tp=2"]


def _load_train():
    """examples/train.py as a module (the one the training tests loaded, if they did)."""
    name = "jax_dsa_example_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    port = free_port()
    procs, logs = [], []
    for pid in range(2):
        log = open(tmp_path / f"worker{pid}.log", "w")
        logs.append(log)
        cmd = [sys.executable, str(WORKER), str(pid), "2", str(port), "4",
               str(tmp_path / f"metrics{pid}.json"), "--", *TRAIN_ARGS]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    try:
        # The reference runs meanwhile, in this process.
        want = _load_train().main(TRAIN_ARGS)
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    for pid, p in enumerate(procs):
        text = (tmp_path / f"worker{pid}.log").read_text()
        assert p.returncode == 0, f"worker {pid} failed:\n{text[-4000:]}"
    assert want["mesh"] == {"dp": 2, "cp": 2, "tp": 2}
    assert want["attention_mode"] == ["sparse"] * 5
    for pid in range(2):
        got = json.loads((tmp_path / f"metrics{pid}.json").read_text())
        assert got["device"]["count"] == 8 and got["mesh"] == want["mesh"]
        for key in ("train_loss", "indexer_loss", "grad_norm"):
            # atol: the indexer's KL is ~2e-4 here, a difference of O(1) log-probabilities, so
            # float32 reduction order shows as ~1e-5 of it (5e-9 absolute seen).
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(got["final_eval_loss"], want["final_eval_loss"], rtol=1e-5)
    assert want["train_loss"][-1] < want["train_loss"][0]
