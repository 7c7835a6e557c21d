"""Speed of dense_mla(..., implementation="cuda"): the SM90 forward kernel in its contiguous mode
(ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py) behind jax_dsa/ops/dense_mla/cuda.py, with its
chunked cuDNN backward and the dense indexer KL loss. Its accuracy is tested by
tests/test_ops_dense_mla_cuda.py on the GPU.

GLM-5 dims, one row: the dense forward at S, in TFLOP/s = 2 * H * (D_qk + d_v) * visible pairs /
time, next to the sparse forward at shape (b) (S_q = S_kv = 16384, K = 2048, all slots valid) in
the same process; the forward+backward; and the dense indexer KL loss (32 index heads x 128, with
the dense forward's lse) forward+backward as a ratio to that dense forward. Host wall-clock
medians of --runs after 3 warm-ups.

    python benchmarks/ops/dense_mla.py [--sizes 4096,16384,65536] [--out [FILE]]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa import dense_mla, indexer_kl_loss, sparse_mla  # noqa: E402
from jax_dsa.ops.dense_mla import cuda as dense_cuda  # noqa: E402

H, D_QK, D_V = 64, 576, 512
H_I, D_I = 32, 128


def median_ms(f, args, n, warm=3):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(t))


def speed(rows, sizes, n):
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    scale = 1 / 16
    # shape (b): the sparse forward, all 2048 slots valid
    s_b, k_b = 16384, 2048
    q = jax.random.normal(k1, (1, s_b, H, D_QK), jnp.bfloat16)
    kv = jax.random.normal(k2, (1, s_b, D_QK), jnp.bfloat16)
    idx = jax.random.randint(k3, (1, s_b, k_b), 0, s_b, jnp.int32)
    sp = jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, sm_scale=scale, d_v=D_V,
                                             implementation="cuda"))
    t_b = median_ms(sp, (q, kv, idx), n)
    tf_b = 2 * H * (D_QK + D_V) * s_b * k_b / t_b / 1e9
    r = dict(check="speed", what="sparse_mla cuda forward, shape (b)", s=s_b, k=k_b, ms=t_b,
             tflops=tf_b)
    print(json.dumps(r), flush=True)
    rows.append(r)
    del q, kv, idx
    for s in sizes:
        q = jax.random.normal(k1, (1, s, H, D_QK), jnp.bfloat16)
        kv = jax.random.normal(k2, (1, s, D_QK), jnp.bfloat16)
        pos = jnp.arange(s, dtype=jnp.int32)[None]
        f = jax.jit(lambda q, kv, p: dense_mla(q, kv, sm_scale=scale, d_v=D_V, q_positions=p,
                                               kv_positions=p, implementation="cuda"))
        t = median_ms(f, (q, kv, pos), n)
        kern = jax.jit(lambda q, kv, p: dense_cuda.cuda_dense_forward(
            q, kv, p, p, None, None, jnp.full((H,), -jnp.inf, jnp.float32), sm_scale=scale,
            d_v=D_V))
        t_k = median_ms(kern, (q, kv, pos), n)
        pairs = s * (s + 1) / 2
        tf = 2 * H * (D_QK + D_V) * pairs / t / 1e9
        r = dict(check="speed", what="dense_mla cuda forward (causal, one document)", s=s, ms=t,
                 glue_and_kernel_ms=t_k, tflops=tf, vs_sparse_b_tflops=tf / tf_b)
        print(json.dumps(r), flush=True)
        rows.append(r)
        fb = jax.jit(jax.grad(lambda q, kv, p: jnp.sum(dense_mla(
            q, kv, sm_scale=scale, d_v=D_V, q_positions=p, kv_positions=p,
            implementation="cuda")[0].astype(jnp.float32)), (0, 1)))
        t_fb = median_ms(fb, (q, kv, pos), n)
        # backward: S and dP recomputed, dQ, dK, dV: 2 * H * (3 * D_qk + 2 * d_v) per pair
        tf_bwd = 2 * H * (3 * D_QK + 2 * D_V) * pairs / (t_fb - t) / 1e9
        r = dict(check="speed", what="dense_mla cuda forward+backward (causal, one document)",
                 s=s, ms=t_fb, backward_ms=t_fb - t, backward_tflops=tf_bwd)
        print(json.dumps(r), flush=True)
        rows.append(r)
        lse = f(q, kv, pos)[1]
        ks = jax.random.split(k3, 3)
        iq = jax.random.normal(ks[0], (1, s, H_I, D_I), jnp.bfloat16)
        ik = jax.random.normal(ks[1], (1, s, D_I), jnp.bfloat16)
        w = jax.random.normal(ks[2], (1, s, H_I), jnp.float32) * H_I ** -0.5
        kl = jax.jit(jax.value_and_grad(lambda iq, ik, w, q, kv, p, lse: indexer_kl_loss(
            iq, ik, w, q, kv, sm_scale=scale, q_positions=p, kv_positions=p, attention_lse=lse,
            implementation="cuda"), argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        jax.block_until_ready(kl(iq, ik, w, q, kv, pos, lse))
        first = time.perf_counter() - t0
        t_kl = median_ms(kl, (iq, ik, w, q, kv, pos, lse), n)
        r = dict(check="speed", what="indexer_kl_loss cuda dense fwd+bwd (attention_lse given)",
                 s=s, ms=t_kl, first_call_s=first, vs_dense_forward=t_kl / t)
        print(json.dumps(r), flush=True)
        rows.append(r)
        del q, kv, iq, ik, w, lse


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--runs", type=int, default=20)
    common.add_result_args(ap)
    a = ap.parse_args()
    rows = []
    res = dict(benchmark="benchmarks/ops/dense_mla.py",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               gpu=jax.devices()[0].device_kind, jax=jax.__version__,
               commit=common.commit(a.commit),
               dims=dict(h=H, d_qk=D_QK, d_v=D_V, batch=1),
               timing="median of --runs host wall-clock runs around block_until_ready after 3 "
                      "warm-ups", rows=rows)
    try:
        speed(rows, [int(x) for x in a.sizes.split(",")], a.runs)
    finally:
        common.write_json(common.out_path(a.out, __file__), res)


if __name__ == "__main__":
    main()
