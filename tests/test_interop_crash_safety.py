"""save_hf over an existing checkpoint, interrupted at any moment, leaves the old checkpoint or the
new one whole (issue 49, item 3).

The saves run in forked children of this process (a fork costs milliseconds; a fresh interpreter
would cost seconds per kill), on a model whose parameters are NumPy arrays, so the child never
touches the XLA runtime. Two tests:

* random moments: SIGKILL at stratified random times over the measured length of a sharded save
  (9 shards over an existing checkpoint of 4 shards and another config), 20 kills;
* every file-system step: the child runs the save with os's file functions (and safetensors'
  ``save_file``) wrapped to count calls, and ends itself with ``os._exit`` before call ``i``,
  for every ``i``.

After each kill, ``load_hf`` must return exactly the old or the new weights (and config), the next
load leaves no litter (staging folder, commit record, temporaries), and the directory holds
exactly the old or the new checkpoint's files.
"""

from __future__ import annotations

import builtins
import gc
import os
import random
import shutil
import signal
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import DSAConfig, RopeParameters
from jax_dsa.interop import load_hf, read_hf_config, save_hf
from jax_dsa.interop import safetensors_io
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.nn import DSALanguageModel

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

TINY = dict(
    model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=4,
    index_n_heads=4, index_head_dim=8, initializer_range=0.2, max_position_embeddings=64,
    mlp_layer_types=("dense", "sparse", "sparse"), moe_intermediate_size=16, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, index_topk_freq=2, index_skip_topk_offset=1,
    tie_word_embeddings=False,
)
KILLS = 20


def _numpy_model(seed: int, rope_theta: float) -> DSALanguageModel:
    """A model whose parameters are NumPy arrays (saving it never runs XLA: fork-safe)."""
    config = DSAConfig(**TINY, rope_parameters=RopeParameters(rope_theta=rope_theta))
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSALanguageModel(config,
                                                                        rngs=nnx.Rngs(0))))
    flat = [(p, v.replace(rng.standard_normal(v.get_value().shape).astype(v.get_value().dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _weights(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


class _Versions:
    """The old and the new checkpoint: weights, rope_theta, file listing, tensors on disk."""

    def __init__(self, tmp, old_shard, new_shard):
        self.old_model, self.new_model = _numpy_model(1, 10000.0), _numpy_model(2, 50000.0)
        self.new_shard = new_shard
        self.old_dir, self.new_dir = tmp / "old", tmp / "new"
        save_hf(self.old_model, self.old_dir, max_shard_size=old_shard)
        save_hf(self.new_model, self.new_dir, max_shard_size=new_shard)
        self.weights = {"old": _weights(self.old_model), "new": _weights(self.new_model)}
        self.theta = {"old": 10000.0, "new": 50000.0}
        self.files = {"old": sorted(os.listdir(self.old_dir)),
                      "new": sorted(os.listdir(self.new_dir))}
        assert self.files["old"] != self.files["new"]
        self.tensors = {}
        for name, d in (("old", self.old_dir), ("new", self.new_dir)):
            with CheckpointReader(d) as r:
                self.tensors[name] = {k: r.read(k) for k in r.keys()}

    def _on_disk(self, path) -> str:
        theta = read_hf_config(path)["rope_parameters"]["rope_theta"]
        with CheckpointReader(path) as r:
            tensors = {k: r.read(k) for k in r.keys()}
        for name in ("old", "new"):
            if theta == self.theta[name] and tensors.keys() == self.tensors[name].keys() and all(
                    np.array_equal(tensors[k], v) for k, v in self.tensors[name].items()):
                return name
        raise AssertionError(f"{path}: neither the old nor the new checkpoint (rope_theta {theta})")

    def which_read_only(self, path) -> str:
        """Which checkpoint the readers see when they may not finish or clear anything (as in
        a read-only directory): through the commit record, if there is one."""
        listing = sorted(os.listdir(path))
        real = safetensors_io._recover

        def refuse(*args, **kwargs):
            raise PermissionError("read-only (test)")

        safetensors_io._recover = refuse
        try:
            name = self._on_disk(path)
        finally:
            safetensors_io._recover = real
        assert sorted(os.listdir(path)) == listing
        return name

    def which(self, path, full: bool = True) -> str:
        """Which checkpoint load_hf returns, exactly (``full=False``: what its readers read,
        without building the model); then the directory must be clean."""
        if full:
            model = load_hf(path, dtype=jnp.float32)
            got = _weights(model)
            theta = model.config.rope_parameters.rope_theta
            for name in ("old", "new"):
                want = self.weights[name]
                if theta == self.theta[name] and got.keys() == want.keys() and all(
                        np.array_equal(got[p], want[p]) for p in want):
                    break
            else:
                raise AssertionError(f"{path}: load_hf gave neither the old nor the new weights")
        else:
            name = self._on_disk(path)
        assert sorted(os.listdir(path)) == self.files[name], (
            f"{path}: litter left after a load: {sorted(os.listdir(path))}")
        return name


def _fork(fn) -> int:
    with warnings.catch_warnings():  # jax's threads: the child touches none of their state
        warnings.simplefilter("ignore", DeprecationWarning)  # Python's multi-thread warning
        warnings.simplefilter("ignore", RuntimeWarning)  # jax's
        pid = os.fork()
    if pid == 0:
        # No garbage collection in the child: jax's gc callback would call into the XLA runtime,
        # whose threads the fork did not copy.
        gc.disable()
        gc.callbacks.clear()
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return pid


def _wait(pid, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the saving child {pid} hung for {timeout} s")
        time.sleep(0.001)


def test_save_hf_killed_at_random_moments(tmp_path):
    v = _Versions(tmp_path, old_shard="40KB", new_shard="20KB")
    assert len([f for f in v.files["new"] if f.startswith("model-")]) >= 9

    def save():
        save_hf(v.new_model, trial, max_shard_size=v.new_shard)
        return 0

    durations = []
    for i in range(2):  # the length of a save, fork included
        trial = tmp_path / f"calibrate{i}"
        shutil.copytree(v.old_dir, trial)
        t0 = time.perf_counter()
        assert _wait(_fork(save)) == 0
        durations.append(time.perf_counter() - t0)
        assert v.which(trial) == "new"
    length = 1.1 * max(durations)
    rng = random.Random(49)
    outcomes = []
    for i in range(KILLS):
        trial = tmp_path / f"kill{i}"
        shutil.copytree(v.old_dir, trial)
        delay = length * (i + rng.random()) / KILLS  # stratified over the save
        pid = _fork(save)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _wait(pid)
        outcomes.append(v.which(trial))
        shutil.rmtree(trial)
    # Kills before the commit leave the old checkpoint, after it the new one. (Which of them the
    # later kills hit depends on the machine's load; the step-by-step test below covers each.)
    assert outcomes[0] == "old", outcomes


# The functions of a save that change the file system (or make it durable).
_STEPS = ("mkdir", "rmdir", "remove", "unlink", "rename", "replace", "fsync")


def _run_until(step: int | None, target, model, shard) -> int:
    """In a fork: save, ending the process before file-system step ``step`` (None: never);
    the child's exit code is the number of steps it took."""

    def child():
        count = 0

        def counted(fn):
            def wrapper(*args, **kwargs):
                nonlocal count
                if count == step:
                    os._exit(200)  # as if killed: nothing after this runs
                count += 1
                return fn(*args, **kwargs)
            return wrapper

        for name in _STEPS:
            setattr(os, name, counted(getattr(os, name)))
        safetensors_io.save_file = counted(safetensors_io.save_file)
        real_open = builtins.open
        counted_open = counted(real_open)
        builtins.open = lambda file, mode="r", *a, **k: (
            counted_open if any(c in mode for c in "wax+") else real_open)(file, mode, *a, **k)
        save_hf(model, target, max_shard_size=shard)
        return min(count, 199)

    return _wait(_fork(child))


@pytest.mark.parametrize("layouts", ["sharded-over-sharded", "single-over-sharded"])
def test_save_hf_killed_at_every_file_system_step(tmp_path, layouts):
    new_shard = "60KB" if layouts == "sharded-over-sharded" else "1MB"
    v = _Versions(tmp_path, old_shard="40KB", new_shard=new_shard)
    shutil.copytree(v.old_dir, tmp_path / "count")
    steps = _run_until(None, tmp_path / "count", v.new_model, v.new_shard)
    assert 10 < steps < 199
    seen = []
    for step in range(steps + 1):
        trial = tmp_path / f"step{step}"
        shutil.copytree(v.old_dir, trial)
        code = _run_until(step, trial, v.new_model, v.new_shard)
        assert code == (200 if step < steps else steps)
        # Read-only, through the commit record, then by load_hf (every third step; its readers
        # otherwise), which finishes or clears.
        before = v.which_read_only(trial)
        full = layouts == "sharded-over-sharded" and step % 3 == 0
        assert v.which(trial, full=full) == before, step
        seen.append(before)
        shutil.rmtree(trial)
    # Old up to the commit, new from it on: one switch, at the commit record's rename.
    switch = seen.index("new")
    assert seen == ["old"] * switch + ["new"] * (steps + 1 - switch), seen
    assert 0 < switch < steps


def test_litter_of_killed_saves_is_cleared_and_live_saves_are_not(tmp_path):
    v = _Versions(tmp_path, old_shard="40KB", new_shard="20KB")
    d = tmp_path / "d"
    shutil.copytree(v.old_dir, d)
    # What earlier versions of save_hf left when killed, and a killed save's staging folder.
    (d / ".tmp-shard-00003.safetensors").write_bytes(b"partial")
    (d / (safetensors_io.STAGING_PREFIX + "killed")).mkdir()
    (d / (safetensors_io.STAGING_PREFIX + "killed") / "part-00000.safetensors").write_bytes(b"x")
    (d / (safetensors_io.COMMIT_FILE + ".tmp")).write_text("{")
    # A live save's staging folder (its writer holds the lock) stays.
    writer = safetensors_io.CheckpointWriter(d, "20KB")
    live = os.path.basename(writer._staging)
    assert v.which_read_only(d) == "old"  # the load cleared the rest
    assert sorted(os.listdir(d)) == sorted(v.files["old"] + [live])
    writer.abort()
    assert sorted(os.listdir(d)) == v.files["old"]
    # A save after a killed one also clears its litter.
    (d / ".tmp-shard-00000.safetensors").write_bytes(b"partial")
    save_hf(v.new_model, d, max_shard_size=v.new_shard)
    assert sorted(os.listdir(d)) == v.files["new"]
