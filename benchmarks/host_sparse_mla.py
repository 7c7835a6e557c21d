"""Host (CPU) sparse_mla: "cpu" (C++ FFI) vs "xla" (pure JAX), forward and forward+backward.

Decides `implementation=None` on the host (jax_dsa.ops.sparse_mla.CPU_PREFERRED_ON_HOST).
Default shape: the training example's glm5-tiny attention (batch 8 x 256 tokens, 4 heads,
D_qk 64 + 16 RoPE = 80, d_v 64, index_topk 64, float32).

    .venv/bin/python benchmarks/host_sparse_mla.py [--out benchmarks/results/host_sparse_mla.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import sparse_mla

SHAPES = {
    # name: (batch, S_q = S_kv, H, D_qk, d_v, K)
    "glm5-tiny-example": (8, 256, 4, 80, 64, 64),
    "larger": (2, 1024, 16, 80, 64, 128),
}


def timed(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, (b, s, h, d, dv, k) in SHAPES.items():
        q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
        kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
        # Causal-style selection: slots past the query position are -1.
        idx = rng.integers(0, s, (b, s, k)).astype(np.int32)
        idx = np.where(idx <= np.arange(s)[None, :, None], idx, -1)
        idx = jnp.asarray(idx)
        for impl in ("xla", "cpu"):
            fwd = jax.jit(lambda q, kv, i, impl=impl: sparse_mla(
                q, kv, i, sm_scale=d**-0.5, d_v=dv, implementation=impl)[0])
            loss = lambda q, kv, i, impl=impl: jnp.sum(sparse_mla(
                q, kv, i, sm_scale=d**-0.5, d_v=dv, implementation=impl)[0] ** 2)
            fwd_bwd = jax.jit(jax.value_and_grad(loss, (0, 1)))
            row = dict(shape=name, batch=b, s=s, h=h, d_qk=d, d_v=dv, k=k, implementation=impl,
                       forward_ms=1e3 * timed(fwd, q, kv, idx, repeats=args.repeats),
                       forward_backward_ms=1e3 * timed(fwd_bwd, q, kv, idx, repeats=args.repeats))
            print(json.dumps(row))
            rows.append(row)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        meta = dict(date=datetime.date.today().isoformat(), commit=commit,
                    machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    jax=jax.__version__, repeats=args.repeats, statistic="median wall time")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
