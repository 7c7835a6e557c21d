"""Speed of implementation="cuda"'s backward, the AOT cuDNN DSA backward. Run on an SM90 GPU
(H100/H200) with jax_dsa's CUDA module built.

    python benchmarks/ops/dsa_bwd.py [--out [FILE]] [--sizes 16384,32768]

Its accuracy against float64 is tests/test_ops_sparse_mla_cuda.py (``make test-gpu``).

1. First-call latency (fresh process state): XLA compile time of a jitted backward, then the
   first and a steady execution (the first includes loading the kernel modules; no JIT).
2. The wide variant (any K) against the 2048 bucket at GLM-5 dims, same inputs.
3. Speed at S_q = S_kv = 16384 and 32768 (all slots valid): median over 50 runs after warm-up of
   (a) the FFI handler alone in a jitted call (host wall time around block_until_ready),
   (b) the whole backward with the public op's glue, (c) the same kernels launched from raw
   pointers through ctypes (jax_dsa_dsa_bwd_raw_bench of the benchmark library
   jax_dsa/libjax_dsa_cuda_bench.so, built with the module unless JAX_DSA_CUDA_BENCH=OFF:
   CUDA-event and wall time). TFLOP/s counts 10 * S_q * K * H * D_qk floating-point operations
   per backward.
"""

from __future__ import annotations

import argparse
import ctypes
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

from jax_dsa import _native, sparse_mla  # noqa: E402
from jax_dsa.ops.sparse_mla import cuda as sparse_mla_cuda  # noqa: E402

BF = jnp.bfloat16


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def prepared(rng, s, h, d, k, sink):
    """Inputs already in the handler's form (flat tokens, all slots valid, K a bucket)."""
    q = jnp.asarray(rng.standard_normal((s, h, d)) * 0.5, BF)
    kv = jnp.asarray(rng.standard_normal((s, d)), BF)
    idx = jnp.asarray(rng.integers(0, s, (s, k)).astype(np.int32))
    att = jnp.asarray(rng.standard_normal(h), jnp.float32) if sink else jnp.full((h,), -jnp.inf, jnp.float32)
    fwd = jax.jit(lambda q, kv, i, a: sparse_mla(q, kv, i, sm_scale=d**-0.5, d_v=512, attn_sink=a,
                                                 implementation="xla"))
    out, lse = fwd(q, kv, idx, att)
    dout = jnp.asarray(rng.standard_normal((s, h, 512)), BF)
    length = jnp.full((s,), k, jnp.int32)
    return dict(q=q, kv=kv, out=out, dout=dout, lse=lse, sink=att, idx=idx, length=length,
                scale=float(d**-0.5))


def handler_call(p):
    s, h, d = p["q"].shape
    ws = sparse_mla_cuda.cuda_workspace_bytes(s, s, h, d)
    call = jax.ffi.ffi_call(sparse_mla_cuda.CUDA_BWD_TARGET, (
        jax.ShapeDtypeStruct((s, h, d), BF), jax.ShapeDtypeStruct((s, d), BF),
        jax.ShapeDtypeStruct((h,), jnp.float32), jax.ShapeDtypeStruct((ws,), jnp.uint8)))
    f = jax.jit(lambda q, kv, o, do, l, a, i, n: call(q, kv, o, do, l, a, i, n,
                                                      sm_scale=np.float32(p["scale"]))[:3])
    return f, (p["q"], p["kv"], p["out"], p["dout"], p["lse"], p["sink"], p["idx"], p["length"])


def handler_chain(p, n):
    """n back-to-back handler calls in one jitted program (side-effecting, so none is merged or
    dropped): per-call time without the per-dispatch host cost."""
    s, h, d = p["q"].shape
    ws = sparse_mla_cuda.cuda_workspace_bytes(s, s, h, d)
    call = jax.ffi.ffi_call(sparse_mla_cuda.CUDA_BWD_TARGET, (
        jax.ShapeDtypeStruct((s, h, d), BF), jax.ShapeDtypeStruct((s, d), BF),
        jax.ShapeDtypeStruct((h,), jnp.float32), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
        has_side_effect=True)

    def f(*args):
        r = None
        for _ in range(n):
            r = call(*args, sm_scale=np.float32(p["scale"]))
        return r[:3]

    return jax.jit(f)


def wall(f, args, iters, warmup=5):
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(t))


def raw_bench(p, iters, wide=False):
    lib = ctypes.CDLL(_native.bench_library())  # raises with the reason if it is not built
    fn = lib.jax_dsa_dsa_bwd_raw_bench
    fn.restype = ctypes.c_int
    s, h, d = p["q"].shape
    k = p["idx"].shape[1]
    dq = jnp.zeros((s, h, d), BF)
    dkv = jnp.zeros((s, d), BF)
    dsink = jnp.zeros((h,), jnp.float32)
    ws = jnp.zeros((sparse_mla_cuda.cuda_workspace_bytes(s, s, h, d),), jnp.uint8)
    bufs = [p["q"], p["kv"], p["out"], p["dout"], p["lse"], p["sink"], p["idx"], p["length"], dq, dkv, dsink, ws]
    jax.block_until_ready(bufs)
    ptrs = [ctypes.c_void_p(b.unsafe_buffer_pointer()) for b in bufs]
    n = iters + 5
    ev = (ctypes.c_float * n)()
    wl = (ctypes.c_double * n)()
    # a negative K asks the library for the wide variant (any K) instead of K's bucket
    rc = fn(*ptrs, ctypes.c_int(s), ctypes.c_int(s), ctypes.c_int(h), ctypes.c_int(d),
            ctypes.c_int(-k if wide else k),
            ctypes.c_float(p["scale"]), ctypes.c_int(n), ev, wl)
    if rc != 0:
        raise RuntimeError(f"raw bench failed: {rc}")
    return float(np.median(list(ev)[5:])), float(np.median(list(wl)[5:])), (dq, dkv, dsink)


def speed(rng, iters, sizes):
    rows = []
    for name, h, d, k, sink in (("glm5", 64, 576, 2048, False), ("deepseek-v4", 64, 512, 640, True)):
        for s in sizes:
            p = prepared(rng, s, h, d, k, sink)
            f, args = handler_call(p)
            t_handler = wall(f, args, iters)
            full = jax.jit(lambda q, kv, i, a, l, o, lse, do: sparse_mla_cuda.cuda_backward(
                q[None], kv[None], i[None], a, l[None], o[None], lse[None], do[None],
                sm_scale=p["scale"], d_v=512))
            t_full = wall(full, (p["q"], p["kv"], p["idx"], p["sink"], p["length"], p["out"], p["lse"], p["dout"]), iters)
            chain = 20
            t_chain = wall(handler_chain(p, chain), args, max(5, iters // chain)) / chain
            t_raw_ev, t_raw_wall, raw_out = raw_bench(p, iters)
            h_out = f(*args)
            # Not bitwise: the kernel accumulates dkv (and dq) with atomics in run-dependent order.
            same = [rel_l2(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                    for a, b in zip(h_out[:2], raw_out[:2])]
            flops = 10 * s * k * h * d
            row = dict(shape=name, s_q=s, s_kv=s, h=h, d_qk=d, d_v=512, k=k, sink=sink,
                       handler_ms=t_handler, backward_with_glue_ms=t_full,
                       raw_harness_event_ms=t_raw_ev, raw_harness_wall_ms=t_raw_wall,
                       handler_overhead_vs_raw_wall=t_handler / t_raw_wall - 1,
                       handler_chained_ms=t_chain,
                       handler_chained_overhead_vs_raw_event=t_chain / t_raw_ev - 1,
                       tflops_handler=flops / t_handler / 1e9, tflops_raw_event=flops / t_raw_ev / 1e9,
                       handler_vs_raw_rel_l2_dq_dkv=same, iters=iters)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del p, args, f
    return rows


def wide_vs_bucket(rng, iters):
    """The wide variant against the 2048 bucket on the same inputs, same process (GLM-5 dims)."""
    p = prepared(rng, 16384, 64, 576, 2048, False)
    bucket_ms, _, b_out = raw_bench(p, iters)
    wide_ms, _, w_out = raw_bench(p, iters, wide=True)
    row = dict(s=16384, h=64, d_qk=576, k=2048, bucket_event_ms=bucket_ms, wide_event_ms=wide_ms,
               wide_over_bucket=wide_ms / bucket_ms,
               wide_vs_bucket_rel_l2_dq_dkv=[
                   rel_l2(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                   for a, b in zip(w_out[:2], b_out[:2])])
    print(json.dumps(row), flush=True)
    return row


def first_call(rng):
    p = prepared(rng, 4096, 64, 576, 2048, False)
    f, args = handler_call(p)
    t0 = time.perf_counter()
    compiled = f.lower(*args).compile()
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t_second = time.perf_counter() - t0
    row = dict(s=4096, h=64, d_qk=576, k=2048, xla_compile_s=t_compile, first_call_ms=1e3 * t_first,
               second_call_ms=1e3 * t_second)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sizes", default="16384,32768")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-first-call", action="store_true")
    common.add_result_args(ap)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print("devices", jax.devices(), "compute_capability", getattr(dev, "compute_capability", None),
          "jax", jax.__version__, "available", _native.available(), _native.LOAD_ERRORS, flush=True)
    rng = np.random.default_rng(0)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpu=getattr(dev, "device_kind", str(dev)), jax=jax.__version__,
                  commit=common.commit(args.commit),
                  flop_count="10 * S_q * K * H * D_qk per backward",
                  timing="median of --iters runs after 5 warm-ups")
    if not args.skip_first_call:
        result["first_call"] = first_call(rng)
    result["wide_vs_bucket"] = wide_vs_bucket(rng, args.iters)
    if not args.skip_speed:
        result["speed"] = speed(rng, args.iters, [int(x) for x in args.sizes.split(",")])
    common.write_json(common.out_path(args.out, __file__), result)


if __name__ == "__main__":
    main()
