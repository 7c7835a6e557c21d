"""Timing of indexer_kl_loss(..., indices=..., implementation="cuda") (the SM90 sparse KL loss:
jax_dsa/ops/indexer/kl_loss/cuda.py, the _cuda_indexer module's kernels).

    python benchmarks/ops/indexer_kl_loss.py [--out [FILE]]
        [--sizes 4096,8192,16384] [--xla-at 4096] [--commit abc1234+uncommitted]

Its accuracy (the kernels against their contracts, the op against the float64 oracle) is
tests/test_ops_indexer_kl_loss_cuda.py (``make test-gpu``).

1. The compiled jax.value_and_grad's count of forward kernel calls (one: XLA merges the
   backward's recomputation with the forward's call).
2. Timing at GLM-5 dims (H 64, D_qk 576, H_I 32 x 128, K 2048, one batch row, causal slots, all
   valid), S = S_q = S_kv in --sizes: median of 25 runs after warm-up (host wall time around
   block_until_ready) of the forward kernel, the backward kernel, the loss alone, and the loss
   with its gradients; "xla" (value and gradients) at --xla-at only (median of 3).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

sys.path.insert(0, str(common.ROOT / "tests"))  # the tests' float64 oracle (rel_l2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa import indexer_kl_loss, sparse_mla  # noqa: E402
from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda  # noqa: E402
from oracle import rel_l2  # noqa: E402

H, D_QK, H_I, K = 64, 576, 32, 2048


def median_ms(f, args, n, warm=2):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts)), float(np.min(ts))


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
    def loss(iq, ik, iw, q, kv, pos, idx, lse=None):
        return indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=scale, q_positions=pos, kv_positions=pos,
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--xla-at", type=int, default=0)
    ap.add_argument("--runs", type=int, default=25)
    common.add_result_args(ap)
    a = ap.parse_args()
    dev = jax.devices()[0]
    res = dict(benchmark="benchmarks/ops/indexer_kl_loss.py",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               gpu=dev.device_kind, jax=jax.__version__, commit=common.commit(a.commit),
               kernels="_cuda_indexer",
               timing="median of --runs host wall-clock runs around block_until_ready, after 2 "
                      "warm-ups",
               rows=[])
    sizes = [int(s) for s in a.sizes.split(",") if s]
    table = timing(res["rows"], sizes, a.xla_at, a.runs)
    common.write_json(common.out_path(a.out, __file__), res)
    print("\n| S | fwd kernel | bwd kernel | loss | loss+grad | xla loss+grad | fwd calls |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['s']} | {r['fwd_kernel_ms']:.2f} | {r['bwd_kernel_ms']:.2f} | "
              f"{r['loss_ms']:.2f} | {r['loss_and_grad_ms']:.2f} | "
              f"{r.get('xla_loss_and_grad_ms', float('nan')):.1f} | "
              f"{r['fwd_kernel_calls_in_value_and_grad']} |")


if __name__ == "__main__":
    main()
