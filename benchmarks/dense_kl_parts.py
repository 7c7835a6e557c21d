"""Where the dense indexer KL loss's time goes on the GPU (GLM-5 dims, one row, causal, H200):
the whole fwd+bwd with ``attention_lse`` given, and each part jitted alone over the same 2048-key
chunks (the index scores' log-sum-exp, the target kernel, kernel B's dense form with the
gradients' accumulation, the chunk lists). Host wall-clock medians of 10 after 2 warm-ups, ms.

    python benchmarks/dense_kl_parts.py [S] [--out results.json]
"""
import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp

from jax_dsa import dense_mla, indexer_kl_loss
from jax_dsa.ops.indexer.kl_loss import cuda as K

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("s", type=int, nargs="?", default=16384)
ap.add_argument("--out", default=None)
a_ = ap.parse_args()
s, out = a_.s, a_.out
H, D_QK, D_V, H_I, D_I, scale = 64, 576, 512, 32, 128, 1 / 16
k = jax.random.split(jax.random.key(0), 6)
q = jax.random.normal(k[0], (1, s, H, D_QK), jnp.bfloat16)
kv = jax.random.normal(k[1], (1, s, D_QK), jnp.bfloat16)
pos = jnp.arange(s, dtype=jnp.int32)[None]
lse = jax.jit(lambda q, kv, p: dense_mla(q, kv, sm_scale=scale, d_v=D_V, q_positions=p,
                                         kv_positions=p, implementation="cuda"))(q, kv, pos)[1]
iq = jax.random.normal(k[2], (1, s, H_I, D_I), jnp.bfloat16)
ik = jax.random.normal(k[3], (1, s, D_I), jnp.bfloat16)
w = jax.random.normal(k[4], (1, s, H_I), jnp.float32) * H_I ** -0.5


def med(f, *a):
    for _ in range(2):
        jax.block_until_ready(f(*a))
    t = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        t.append(time.perf_counter() - t0)
    return sorted(t)[5] * 1e3


full = jax.jit(jax.value_and_grad(lambda iq, ik, w, q, kv, p, lse: indexer_kl_loss(
    iq, ik, w, q, kv, sm_scale=scale, q_positions=p, kv_positions=p, attention_lse=lse,
    implementation="cuda"), argnums=(0, 1, 2)))
lse_only = jax.jit(lambda iq, ik, w, p: K.KERNELS["index_lse"](iq, ik, w, p, p, None, None))


def target_only(q, kv, p, lse):
    def step(c, idx, n):
        return c + jnp.sum(K.KERNELS["target"](q, kv, idx, lse, sm_scale=scale, topk_length=n))
    return K.scan_dense_chunks(p, p, None, None, s, step, jnp.float32(0))[0]


def bwd_only(iq, ik, w, p):
    li = jnp.zeros(p.shape, jnp.float32)
    def step(c, idx, n):
        tgt = jnp.where(idx >= 0, 1.0 / 2048, 0.0).astype(jnp.float32)
        *g, sc = K.KERNELS["dense_backward"](iq, ik, w, idx, tgt, li)
        return tuple(a + b for a, b in zip(c, g))
    init = tuple(jnp.zeros(x.shape, jnp.float32) for x in (iq, ik, w))
    return K.scan_dense_chunks(p, p, None, None, s, step, init)[0]


def chunks_only(p):
    return K.scan_dense_chunks(p, p, None, None, s, lambda c, idx, n: c + jnp.sum(idx), jnp.int32(0))[0]


r = dict(s=s, full=med(full, iq, ik, w, q, kv, pos, lse), index_lse=med(lse_only, iq, ik, w, pos),
         target_chunks=med(jax.jit(target_only), q, kv, pos, lse),
         dense_bwd_chunks=med(jax.jit(bwd_only), iq, ik, w, pos),
         chunk_lists=med(jax.jit(chunks_only), pos))
print(json.dumps(r))
if out:
    meta = dict(benchmark="benchmarks/dense_kl_parts.py", gpu=jax.devices()[0].device_kind,
                date=datetime.date.today().isoformat(), jax=jax.__version__,
                dims=dict(h=H, d_qk=D_QK, index_heads=H_I, index_head_dim=D_I, batch=1))
    with open(out, "w") as f:
        json.dump(dict(meta, ms=r), f, indent=1)
