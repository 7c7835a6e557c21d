"""Speed of indexer_topk(implementation="cuda") on an SM90 GPU, with "xla" for the ratio.

    python benchmarks/ops/indexer_topk.py [--out [FILE]] [--reps 20] [--no-xla] [--only 16k]

GLM-5's indexer (index heads 32, head dim 128, topk 2048) at S_q = S_kv in {4096, 16384, 32768}
causal, and S_kv = 131072 with the last 4096 positions as queries; V3.2's 64 heads at 16384.
Each time is the median of --reps jitted calls after 3 warm-up calls, host wall time around
block_until_ready, fresh random bf16 inputs (no zeros); ``cuda_device_ms`` is the same call's GPU
time (its kernels' durations in a profiler trace, no launch or synchronisation latency: the
measure of CUDA-event timings) and ``cuda_pipelined_ms`` the wall time a call with --reps calls
queued and one wait at the end; ``cuda_device_kernels`` splits the GPU time by kernel (score,
top-k). Beside it: the whole call for ``qk_dtype="float8_e4m3fn"`` (the bf16 kernels on the exact
fp8 values, quantization included), and the share of the 256 longest rows' keys that bf16 and fp8
both select. Command buffers are turned off (XLA_FLAGS), as in the stored results. The kernels'
own CUDA-event times (score kernel alone, top-k kernel alone) come from ``topk_selftest --bench``
(ffi/cuda/selftest/topk_selftest.cu, built with JAX_DSA_CUDA_SELFTEST=ON).

TFLOP/s counts the score products of the visible pairs only: 2 * H_I * D_I * visible_pairs.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_dsa  # noqa: E402


def timed(f, args, reps):
    for _ in range(3):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3, float(np.min(ts)) * 1e3


def pipelined(f, args, reps):
    """ms a call with ``reps`` calls queued back to back and one wait at the end (a training
    step's situation: the host runs ahead of the GPU)."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--only", default="", help="time only the shapes whose name contains this")
    common.add_result_args(ap)
    a = ap.parse_args()
    dev = jax.devices()[0]
    print("device:", dev.device_kind, getattr(dev, "compute_capability", None), flush=True)
    shapes = [  # (name, H_I, S_q, S_kv, topk, q offset, time xla)
        ("glm5 4k causal", 32, 4096, 4096, 2048, 0, True),
        ("glm5 16k causal", 32, 16384, 16384, 2048, 0, True),
        ("glm5 32k causal", 32, 32768, 32768, 2048, 0, False),
        ("glm5 128k kv, last 4096 q", 32, 4096, 131072, 2048, 131072 - 4096, False),
        ("v3.2 16k causal (h64)", 64, 16384, 16384, 2048, 0, False),
    ]
    key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
    rows = []
    for name, h, s_q, s_kv, topk, off, with_xla in shapes:
        if a.only not in name:
            continue
        k1, k2, k3, key = jax.random.split(key, 4)
        q = (jax.random.normal(k1, (s_q, h, 128), jnp.float32) * 0.5).astype(jnp.bfloat16)
        kk = jax.random.normal(k2, (s_kv, 128), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(k3, (s_q, h), jnp.float32) * (h ** -0.5) * (128 ** -0.5)
        q_pos = jnp.arange(s_q, dtype=jnp.int32) + off
        kv_pos = jnp.arange(s_kv, dtype=jnp.int32)
        visible = int(np.sum(np.minimum(np.arange(s_q) + off + 1, s_kv)))
        flops = 2 * h * 128 * visible

        def make(impl, qk_dtype=None):
            return jax.jit(lambda q, k, w, qp, kp: jax_dsa.indexer_topk(
                q, k, w, topk=topk, q_positions=qp, kv_positions=kp, qk_dtype=qk_dtype,
                implementation=impl))

        args = (q, kk, w, q_pos, kv_pos)
        f = make("cuda")
        row = dict(name=name, index_heads=h, head_dim=128, s_q=s_q, s_kv=s_kv, topk=topk,
                   causal_q_offset=off, visible_pairs=visible)
        row["cuda_ms"], row["cuda_min_ms"] = timed(f, args, a.reps)
        row["cuda_pipelined_ms"] = pipelined(f, args, a.reps)
        trace = common.kernel_times(f, args, a.reps, top=8)
        row["cuda_device_ms"] = trace["busy_ms"]
        row["cuda_device_kernels"] = trace["kernels"]
        row["score_tflops"] = flops / (row["cuda_ms"] * 1e-3) / 1e12
        # The fp8 scores (qk_dtype="float8_e4m3fn"): the whole call includes the quantization.
        f8 = make("cuda", "float8_e4m3fn")
        row["fp8_ms"], _ = timed(f8, args, a.reps)
        sel, sel8 = (np.asarray(g(*args)[-256:]) for g in (f, f8))  # the longest rows
        row["fp8_same_keys_frac"] = float(np.mean([len(set(x) & set(y)) / len(set(x))
                                                   for x, y in zip(sel, sel8)]))
        if with_xla and not a.no_xla:
            row["xla_ms"], _ = timed(make("xla"), args, max(5, a.reps // 2))
            row["xla_over_cuda"] = row["xla_ms"] / row["cuda_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, kk, w, f

    commit = common.commit(a.commit)
    result = dict(date=datetime.date.today().isoformat(), gpu=dev.device_kind,
                  compute_capability=str(getattr(dev, "compute_capability", None)),
                  jax=jax.__version__, commit=commit, timing="median of %d jitted calls after 3 "
                  "warm-ups, host wall time around block_until_ready; command buffers off; "
                  "cuda_device_ms: the kernels' summed GPU time a call over as many traced calls "
                  "(benchmarks.common.kernel_times); cuda_pipelined_ms: as many calls queued, one "
                  "wait" % a.reps,
                  tflops="2 * H_I * D_I * visible pairs / time", rows=rows)
    common.write_json(common.out_path(a.out, __file__), result)
    print()
    # The kernels' split (scores, top-k) is in each row's cuda_device_kernels.
    print(f"{'shape':28s} {'cuda ms':>8s} {'queued':>8s} {'device':>8s} "
          f"{'TFLOP/s':>8s} {'fp8 ms':>8s} {'xla ms':>8s} {'xla/cuda':>8s}")
    for r in rows:
        print(f"{r['name']:28s} {r['cuda_ms']:8.2f} {r['cuda_pipelined_ms']:8.2f} "
              f"{r['cuda_device_ms']:8.2f} {r['score_tflops']:8.1f} {r['fp8_ms']:8.2f} "
              f"{r.get('xla_ms', float('nan')):8.2f} {r.get('xla_over_cuda', float('nan')):8.1f}")


if __name__ == "__main__":
    main()
