"""Where the dense indexer KL loss's time goes on the GPU (GLM-5 dims, one row, causal): the whole
fwd+bwd with ``attention_lse`` given, and each part jitted alone over the same 2048-key chunks
(the index scores' log-sum-exp, the target kernel, kernel B's dense form with the gradients'
accumulation, the chunk lists). Host wall-clock medians of 10 after 2 warm-ups, ms.

    python benchmarks/ops/dense_kl_parts.py [S] [--out [FILE]]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_dsa import dense_mla, indexer_kl_loss  # noqa: E402
from jax_dsa.ops.indexer.kl_loss import cuda as K  # noqa: E402

H, D_QK, D_V, H_I, D_I, SCALE = 64, 576, 512, 32, 128, 1 / 16


def med(f, *a):
    for _ in range(2):
        jax.block_until_ready(f(*a))
    t = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        t.append(time.perf_counter() - t0)
    return sorted(t)[5] * 1e3


def parts(s):
    """The jitted whole loss and its parts; every array is an argument."""
    full = jax.jit(jax.value_and_grad(lambda iq, ik, w, q, kv, p, lse: indexer_kl_loss(
        iq, ik, w, q, kv, sm_scale=SCALE, q_positions=p, kv_positions=p, attention_lse=lse,
        implementation="cuda"), argnums=(0, 1, 2)))
    lse_only = jax.jit(lambda iq, ik, w, p: K.index_lse_kernel(iq, ik, w, p, p, None, None))

    @jax.jit
    def target_only(q, kv, p, lse):
        def step(c, idx, n):
            return c + jnp.sum(K.target_kernel(q, kv, idx, lse, sm_scale=SCALE, topk_length=n))
        return K.scan_dense_chunks(p, p, None, None, s, step, jnp.float32(0))[0]

    @jax.jit
    def bwd_only(iq, ik, w, p):
        li = jnp.zeros(p.shape, jnp.float32)

        def step(c, idx, n):
            tgt = jnp.where(idx >= 0, 1.0 / 2048, 0.0).astype(jnp.float32)
            *g, sc = K.dense_backward_kernel(iq, ik, w, idx, tgt, li)
            return tuple(a + b for a, b in zip(c, g))
        init = tuple(jnp.zeros(x.shape, jnp.float32) for x in (iq, ik, w))
        return K.scan_dense_chunks(p, p, None, None, s, step, init)[0]

    @jax.jit
    def chunks_only(p):
        return K.scan_dense_chunks(p, p, None, None, s, lambda c, idx, n: c + jnp.sum(idx),
                                   jnp.int32(0))[0]

    return full, lse_only, target_only, bwd_only, chunks_only


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("s", type=int, nargs="?", default=16384)
    common.add_result_args(ap)
    a = ap.parse_args(argv)
    s = a.s
    k = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(k[0], (1, s, H, D_QK), jnp.bfloat16)
    kv = jax.random.normal(k[1], (1, s, D_QK), jnp.bfloat16)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    lse = jax.jit(lambda q, kv, p: dense_mla(q, kv, sm_scale=SCALE, d_v=D_V, q_positions=p,
                                             kv_positions=p, implementation="cuda"))(q, kv, pos)[1]
    iq = jax.random.normal(k[2], (1, s, H_I, D_I), jnp.bfloat16)
    ik = jax.random.normal(k[3], (1, s, D_I), jnp.bfloat16)
    w = jax.random.normal(k[4], (1, s, H_I), jnp.float32) * H_I ** -0.5
    full, lse_only, target_only, bwd_only, chunks_only = parts(s)
    r = dict(s=s, full=med(full, iq, ik, w, q, kv, pos, lse),
             index_lse=med(lse_only, iq, ik, w, pos),
             target_chunks=med(target_only, q, kv, pos, lse),
             dense_bwd_chunks=med(bwd_only, iq, ik, w, pos), chunk_lists=med(chunks_only, pos))
    print(json.dumps(r))
    common.write_json(common.out_path(a.out, __file__), dict(
        benchmark="benchmarks/ops/dense_kl_parts.py", gpu=jax.devices()[0].device_kind,
        date=common.today(), commit=common.commit(a.commit), jax=jax.__version__,
        dims=dict(h=H, d_qk=D_QK, index_heads=H_I, index_head_dim=D_I, batch=1), ms=r))


if __name__ == "__main__":
    main()
