"""GPU check and timing of indexer_kl_loss(..., indices=..., implementation="cuda") (the SM90
sparse KL loss: jax_dsa/ops/indexer/kl_loss_cuda.py, ffi/cuda/indexer/kl_loss*.cu).

    python benchmarks/gpu_indexer_kl_loss.py --out results.json [--lib libkl_loss.so]
        [--sizes 4096,8192,16384] [--xla-at 4096] [--commit abc1234+uncommitted]

``--lib`` registers a standalone build of the two FFI handlers (before the ``_cuda_indexer``
module carries them); without it the module's targets are used.

1. Kernels against their pure-JAX contracts (kl_loss_cuda.reference_*_kernel, float32 on the
   GPU): the forward's target mass and index score, the backward's three gradients, at small
   shapes with -1 / out-of-range slots, duplicates, empty rows, packed documents, padded heads.
2. The public op (value and gradients) against the float64 NumPy oracle of
   tests/test_indexer_kl_loss_cuda.py on bf16-rounded inputs. Pass: loss rel <= 1e-3, gradients
   finite with rel L2 <= 1e-2.
3. The compiled jax.value_and_grad holds the forward kernel once (XLA merges the backward's
   recomputation with the forward's call).
4. Timing at GLM-5 dims (H 64, D_qk 576, H_I 32 x 128, K 2048, one batch row, causal slots, all
   valid), S = S_q = S_kv in --sizes: median of 25 runs after warm-up (host wall time around
   block_until_ready) of the forward kernel, the backward kernel, the loss alone, and the loss
   with its gradients; "xla" (value and gradients) at --xla-at only (median of 3).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from jax_dsa import sparse_mla  # noqa: E402
from jax_dsa.ops.indexer import kl_loss_xla  # noqa: E402
from jax_dsa.ops.indexer.kl_loss import op as kl_loss
from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.registry import Registry  # noqa: E402
from test_indexer_kl_loss_cuda import make_inputs, numpy_oracle, rel_l2  # noqa: E402

H, D_QK, H_I, K = 64, 576, 32, 2048


def op():
    if "cuda" not in kl_loss.REGISTRY:
        kl_loss.REGISTRY = Registry(
            "indexer_kl_loss", (kl_loss_xla.IMPLEMENTATION, kl_loss_cuda.IMPLEMENTATION),
            preference={"default": ("xla",)})
    return kl_loss.indexer_kl_loss


def median_ms(f, args, n, warm=2):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts)), float(np.min(ts))


def max_rel(got, want, mask=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    return float(np.abs(got - want).max(initial=0) / max(np.abs(want).max(initial=0), 1e-30))


def kernel_checks(rows):
    cases = [
        dict(nb=2, s_q=40, s_kv=70, h=80, d_qk=512, h_i=5, k=300, segments=True),
        dict(nb=1, s_q=33, s_kv=3000, h=64, d_qk=576, h_i=32, k=2048, segments=False),
        dict(nb=1, s_q=20, s_kv=20, h=16, d_qk=576, h_i=64, k=37, segments=True),
    ]
    ok_all = True
    for c in cases:
        x = make_inputs(np.random.default_rng(c["k"]), c["nb"], c["s_q"], c["s_kv"], c["h"],
                        c["d_qk"], c["h_i"], c["k"], c["segments"])
        args = tuple(None if x[n] is None else jnp.asarray(x[n]) for n in
                     ("iq", "ik", "iw", "q_pos", "kv_pos", "q_seg", "kv_seg", "q", "kv", "idx"))
        scale = c["d_qk"] ** -0.5
        fk = jax.jit(lambda *a: kl_loss_cuda.forward_kernel(*a, sm_scale=scale))
        rk = jax.jit(lambda *a: kl_loss_cuda.reference_forward_kernel(*a, sm_scale=scale))
        mass, score = fk(*args)
        rmass, rscore = rk(*args)
        sup = np.isfinite(np.asarray(rscore))
        same_support = bool(np.array_equal(np.isfinite(np.asarray(score)), sup))
        e_mass = max_rel(mass, rmass)
        e_score = max_rel(score, rscore, sup)
        ds = np.random.default_rng(1).standard_normal(x["idx"].shape).astype(np.float32)
        ds = jnp.asarray(np.where(sup, ds, 0))
        bk = jax.jit(kl_loss_cuda.backward_kernel)(args[0], args[1], args[2], args[9], ds)
        rb = jax.jit(kl_loss_cuda.reference_backward_kernel)(args[0], args[1], args[2], args[9], ds)
        e_b = [rel_l2(a, b) for a, b in zip(bk, rb)]
        finite = all(bool(np.all(np.isfinite(np.asarray(a)))) for a in (mass, *bk))
        ok = bool(same_support and finite and e_mass < 1e-4 and e_score < 1e-4 and max(e_b) < 1e-2)
        ok_all &= ok
        row = dict(check="kernels vs contract", **c, support_equal=same_support,
                   mass_max_rel=e_mass, score_max_rel=e_score, d_iq_rel_l2=e_b[0],
                   d_ik_rel_l2=e_b[1], d_w_rel_l2=e_b[2], finite=finite, passed=ok)
        rows.append(row)
        print(row, flush=True)
    return ok_all


OP_CASES = [
        dict(nb=2, s_q=512, s_kv=640, h=64, d_qk=576, h_i=32, k=256, segments=True),
        dict(nb=1, s_q=1024, s_kv=1024, h=64, d_qk=576, h_i=32, k=2048, segments=False),
        dict(nb=1, s_q=2048, s_kv=2048, h=64, d_qk=576, h_i=32, k=512, segments=True),
        dict(nb=1, s_q=600, s_kv=700, h=128, d_qk=512, h_i=64, k=1000, segments=True),
]


def op_checks(rows, cases=None):
    cases = OP_CASES if cases is None else cases
    f = op()
    ok_all = True
    for c in cases:
        x = make_inputs(np.random.default_rng(c["s_q"] + c["k"]), c["nb"], c["s_q"], c["s_kv"],
                        c["h"], c["d_qk"], c["h_i"], c["k"], c["segments"])
        scale = c["d_qk"] ** -0.5

        def loss(iq, ik, iw, q, kv, qp, kp, qs, ks, idx):
            return f(iq, ik, iw, q, kv, sm_scale=scale, q_positions=qp, kv_positions=kp,
                     q_segment_ids=qs, kv_segment_ids=ks, indices=idx, implementation="cuda")

        g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        val, grads = g(*(None if x[n] is None else jnp.asarray(x[n]) for n in
                         ("iq", "ik", "iw", "q", "kv", "q_pos", "kv_pos", "q_seg", "kv_seg",
                          "idx")))
        t0 = time.perf_counter()
        ref = numpy_oracle(x, scale)
        t_ref = time.perf_counter() - t0
        e_loss = abs(float(val) - ref[0]) / abs(ref[0])
        e_g = [rel_l2(a, b) for a, b in zip(grads, ref[1:])]
        finite = all(bool(np.all(np.isfinite(np.asarray(a)))) for a in grads)
        ok = bool(e_loss <= 1e-3 and max(e_g) <= 1e-2 and finite)
        ok_all &= ok
        row = dict(check="op vs float64 oracle", **c, loss=float(val), loss_ref=ref[0],
                   loss_rel=e_loss, d_iq_rel_l2=e_g[0], d_ik_rel_l2=e_g[1], d_w_rel_l2=e_g[2],
                   finite=finite, oracle_s=t_ref, passed=ok)
        rows.append(row)
        print(row, flush=True)
    return ok_all


def timing_inputs(s, key):
    ks = jax.random.split(jax.random.key(key), 7)
    bf = jnp.bfloat16
    iq = jax.random.normal(ks[0], (1, s, H_I, 128), bf)
    ik = jax.random.normal(ks[1], (1, s, 128), bf)
    iw = jax.random.normal(ks[2], (1, s, H_I), jnp.float32) * (H_I * 128) ** -0.5
    q = jax.random.normal(ks[3], (1, s, H, D_QK), bf)
    kv = jax.random.normal(ks[4], (1, s, D_QK), bf)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    u = jax.random.uniform(ks[5], (1, s, K))
    idx = jnp.floor(u * (pos[..., None] + 1).astype(jnp.float32)).astype(jnp.int32)
    return iq, ik, iw, q, kv, pos, idx


def loss_fn(impl, scale, given_lse=False):
    f = op()

    def loss(iq, ik, iw, q, kv, pos, idx, lse=None):
        return f(iq, ik, iw, q, kv, sm_scale=scale, q_positions=pos, kv_positions=pos,
                 indices=idx, attention_lse=lse if given_lse else None, implementation=impl)

    return loss


def timing(rows, sizes, xla_at, n):
    scale = D_QK ** -0.5
    table = []
    for s in sizes:
        args = timing_inputs(s, s)
        iq, ik, iw, q, kv, pos, idx = args
        r = dict(check="timing", s=s, h=H, d_qk=D_QK, h_i=H_I, k=K, batch=1)
        loss = loss_fn("cuda", scale)
        vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        hlo = vg.lower(*args).compile().as_text()
        r["fwd_kernel_calls_in_value_and_grad"] = hlo.count(
            f'custom_call_target="{kl_loss_cuda.FWD_TARGET}"')
        r["bwd_kernel_calls_in_value_and_grad"] = hlo.count(
            f'custom_call_target="{kl_loss_cuda.BWD_TARGET}"')
        fk = jax.jit(lambda *a: kl_loss_cuda.forward_kernel(*a, sm_scale=scale))
        fargs = (iq, ik, iw, pos, pos, None, None, q, kv, idx)
        r["fwd_kernel_ms"], _ = median_ms(lambda *a: fk(*a), fargs, n)
        ds = jax.random.normal(jax.random.key(9), idx.shape, jnp.float32) * 1e-4
        bk = jax.jit(kl_loss_cuda.backward_kernel)
        r["bwd_kernel_ms"], _ = median_ms(bk, (iq, ik, iw, idx, ds), n)
        r["loss_ms"], _ = median_ms(jax.jit(loss), args, n)
        r["loss_and_grad_ms"], r["loss_and_grad_min_ms"] = median_ms(vg, args, n)
        # The same loss with sparse_mla's lse passed in (attention_lse): the target from the
        # attention kernel's target mode plus kernel A's score-only launch.
        lse = jax.jit(lambda q, kv, idx: sparse_mla(q, kv, idx, sm_scale=scale, d_v=512,
                                                    implementation="cuda")[1])(q, kv, idx)
        vgl = jax.jit(jax.value_and_grad(loss_fn("cuda", scale, True), argnums=(0, 1, 2)))
        largs = args + (lse,)
        r["given_lse_loss_and_grad_ms"], _ = median_ms(vgl, largs, n)
        tk = jax.jit(lambda q, kv, idx, lse: kl_loss_cuda.target_kernel(q, kv, idx, lse,
                                                                      sm_scale=scale))
        r["given_lse_target_kernel_ms"], _ = median_ms(tk, (q, kv, idx, lse), n)
        sk = jax.jit(kl_loss_cuda.score_kernel)
        r["given_lse_score_kernel_ms"], _ = median_ms(sk, (iq, ik, iw, pos, pos, None, None,
                                                           q, kv, idx), n)
        got, want = vgl(*largs), vg(*args)
        r["given_lse_vs_recomputed_loss_rel"] = abs(float(got[0]) - float(want[0])) / abs(
            float(want[0]))
        r["given_lse_vs_recomputed_grad_rel_l2"] = [rel_l2(a, b) for a, b in zip(got[1], want[1])]
        r["runs"] = n
        if s == xla_at:
            xg = jax.jit(jax.value_and_grad(loss_fn("xla", scale), argnums=(0, 1, 2)))
            t0 = time.perf_counter()
            want = jax.block_until_ready(xg(*args))
            r["xla_first_call_s"] = time.perf_counter() - t0
            r["xla_loss_and_grad_ms"], _ = median_ms(xg, args, 3, warm=0)
            got = vg(*args)
            r["vs_xla_loss_rel"] = abs(float(got[0]) - float(want[0])) / abs(float(want[0]))
            r["vs_xla_grad_rel_l2"] = [rel_l2(a, b) for a, b in zip(got[1], want[1])]
        rows.append(r)
        table.append(r)
        print(r, flush=True)
        del args, iq, ik, iw, q, kv, pos, idx
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--xla-at", type=int, default=0)
    ap.add_argument("--runs", type=int, default=25)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--skip-checks", action="store_true", help="no accuracy checks at all")
    ap.add_argument("--skip-op-checks", action="store_true",
                    help="kernel checks only (the op checks are the GPU tests' cases)")
    a = ap.parse_args()
    dev = jax.devices()[0]
    res = dict(benchmark="benchmarks/gpu_indexer_kl_loss.py",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               gpu=dev.device_kind, jax=jax.__version__, commit=a.commit,
               kernels="_cuda_indexer",
               timing="median of --runs host wall-clock runs around block_until_ready, after 2 "
                      "warm-ups",
               rows=[])
    passed = True
    if not a.skip_checks:
        passed &= kernel_checks(res["rows"])
        if not a.skip_op_checks:
            passed &= op_checks(res["rows"])
    res["checks_passed"] = passed
    sizes = [int(s) for s in a.sizes.split(",") if s]
    table = timing(res["rows"], sizes, a.xla_at, a.runs)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("\n| S | fwd kernel | bwd kernel | loss | loss+grad | xla loss+grad | fwd calls |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['s']} | {r['fwd_kernel_ms']:.2f} | {r['bwd_kernel_ms']:.2f} | "
              f"{r['loss_ms']:.2f} | {r['loss_and_grad_ms']:.2f} | "
              f"{r.get('xla_loss_and_grad_ms', float('nan')):.1f} | "
              f"{r['fwd_kernel_calls_in_value_and_grad']} |")
    print("checks passed:", passed)


if __name__ == "__main__":
    main()
