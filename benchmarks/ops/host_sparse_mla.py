"""Host (CPU) sparse_mla: "cpu" (C++ FFI) vs "xla" (pure JAX), forward and forward+backward.

The measurement behind `implementation=None`'s order on the host ("cpu" first: the "cpu" entry
of the registry's preference in jax_dsa/ops/sparse_mla/op.py). Shapes: the training example's
glm5-tiny attention (batch 8 x 256 tokens, 4 heads, D_qk 64 + 16 RoPE = 80, d_v 64, index_topk
64) and a larger one, float32; median of --repeats after compile.

    .venv/bin/python benchmarks/ops/host_sparse_mla.py [--repeats 20] [--out [FILE]]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa import sparse_mla  # noqa: E402

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    common.add_result_args(ap)
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
    meta = dict(benchmark="benchmarks/ops/host_sparse_mla.py", date=common.today(),
                commit=common.commit(args.commit),
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                jax=jax.__version__, repeats=args.repeats, statistic="median wall time")
    common.write_json(common.out_path(args.out, __file__), dict(meta=meta, results=rows))


if __name__ == "__main__":
    main()
