"""GPU check and timing of dense_mla(..., implementation="cuda"): the SM90 forward kernel in its
contiguous mode (ffi/cuda/sparse_mla_fwd_sm90.py) behind jax_dsa/ops/dense_mla/cuda.py.

Accuracy: out and lse against the float64 "xla" implementation on bf16-rounded inputs (packed
documents, S not a multiple of the 64-row tile, a sink, rows that see no key), and against
sparse_mla's "cuda" forward over the same keys as a slot list. Speed (GLM-5 dims, one row): the
dense forward at S, in TFLOP/s = 2 * H * (D_qk + d_v) * visible pairs / time, next to the sparse
forward at shape (b) (S_q = S_kv = 16384, K = 2048, all slots valid) in the same process, and
the dense indexer KL loss (32 index heads x 128, with the dense forward's lse) forward+backward
as a ratio to that dense forward.

    python benchmarks/gpu_dense_mla.py --out results.json [--sizes 4096,16384,65536]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import dense_mla, indexer_kl_loss, sparse_mla
from jax_dsa.nn.slots import dense_indices
from jax_dsa.ops.dense_mla import cuda as dense_cuda

H, D_QK, D_V = 64, 576, 512
H_I, D_I = 32, 128


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def median_ms(f, args, n, warm=3):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(t))


def packed(rng, b, s, n_docs):
    """Per-row document ids and per-document positions for ``n_docs`` random cuts."""
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), n_docs - 1, replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(s), side="right")
        start = np.concatenate([[0], cuts])[seg[r]]
        pos[r] = np.arange(s) - start
    return seg, pos


def accuracy(rng, rows):
    cases = [
        ("glm5 H64 D576 S1000 packed", 1, 1000, 64, 576, 4, False, False),
        ("v4 H64 D512 S777 sink B2 packed", 2, 777, 64, 512, 3, True, False),
        ("glm5 H16 D576 S300 kv ahead", 1, 300, 16, 576, 1, False, True),
    ]
    for name, b, s, h, d, docs, sink, ahead in cases:
        q = jnp.asarray(rng.standard_normal((b, s, h, d)) * 0.5, jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
        seg, pos = packed(rng, b, s, docs)
        q_pos = pos.copy()
        if ahead:  # the first queries see no key
            q_pos[:, :10] = -1
        att = jnp.asarray(rng.standard_normal(h) * 1.5, jnp.float32) if sink else None
        segs = (jnp.asarray(seg), jnp.asarray(seg)) if docs > 1 else (None, None)
        kw = dict(sm_scale=d ** -0.5, d_v=D_V, q_positions=jnp.asarray(q_pos),
                  kv_positions=jnp.asarray(pos), q_segment_ids=segs[0], kv_segment_ids=segs[1],
                  attn_sink=att)
        out, lse = jax.jit(lambda q, kv: dense_mla(q, kv, implementation="cuda", **kw))(q, kv)
        with jax.enable_x64(True):
            kw64 = dict(kw, attn_sink=None if att is None else att.astype(jnp.float64))
            ref_out, ref_lse = dense_mla(q.astype(jnp.float64), kv.astype(jnp.float64),
                                         implementation="xla", **kw64)
            ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
        lse_np = np.asarray(lse)
        empty = ~np.isfinite(ref_lse)
        idx = dense_indices(jnp.asarray(q_pos), jnp.asarray(pos), *segs)
        sp_out, sp_lse = jax.jit(lambda q, kv, i: sparse_mla(
            q, kv, i, sm_scale=kw["sm_scale"], d_v=D_V, attn_sink=att,
            implementation="cuda"))(q, kv, idx)
        fin = np.isfinite(lse_np)
        r = dict(check="accuracy", case=name,
                 out_rel_l2_vs_f64=rel_l2(np.asarray(out, np.float32), ref_out),
                 lse_max_abs_vs_f64=float(np.max(np.abs(np.where(empty, 0, lse_np - ref_lse)))),
                 empty_rows_lse_inf=bool(np.all(np.isinf(lse_np[empty]))),
                 empty_rows_out_zero=bool(np.all(np.asarray(out, np.float32)[empty] == 0)),
                 finite=bool(np.all(np.isfinite(np.asarray(out, np.float32)))),
                 out_rel_l2_vs_sparse_cuda=rel_l2(np.asarray(out, np.float32),
                                                  np.asarray(sp_out, np.float32)),
                 lse_max_abs_vs_sparse_cuda=float(np.max(np.abs(np.where(
                     fin, lse_np - np.asarray(sp_lse), 0)))))
        r["ok"] = (r["out_rel_l2_vs_f64"] < 1e-2 and r["lse_max_abs_vs_f64"] < 1e-2
                   and r["empty_rows_lse_inf"] and r["empty_rows_out_zero"] and r["finite"])
        print(json.dumps(r), flush=True)
        rows.append(r)


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    rows = []
    res = dict(benchmark="benchmarks/gpu_dense_mla.py",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               gpu=jax.devices()[0].device_kind, jax=jax.__version__, commit=a.commit,
               dims=dict(h=H, d_qk=D_QK, d_v=D_V, batch=1),
               timing="median of --runs host wall-clock runs around block_until_ready after 3 "
                      "warm-ups", rows=rows)
    try:
        accuracy(np.random.default_rng(0), rows)
        speed(rows, [int(x) for x in a.sizes.split(",")], a.runs)
    finally:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
