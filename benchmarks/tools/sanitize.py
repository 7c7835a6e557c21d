"""Small launches of every jax_dsa CUDA kernel mode, for compute-sanitizer (memcheck, racecheck,
synccheck) on an SM90 GPU:

    XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
        python benchmarks/tools/sanitize.py [--only-dense | --only-indexer]

The forward kernel's slot-list, contiguous (dense_mla) and target modes, the backward's bucket
and wide variants, indexer_topk, the sparse KL loss's kernels (kernel A, its score-only launch,
kernel B; with the top-k's scores given), and the dense forms' chunked launches (dense_mla's
backward, the dense KL losses of GLM-5 and DeepSeek V4, with chunks cut small so that rows end
inside and before a chunk). ``--only-indexer``: the top-k (with its scores), the sparse KL with
those scores and the V4 dense KL only. Shapes: partial tiles, invalid
slots, a row without any, two head groups.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import dense_mla, indexer_kl_loss, indexer_topk, sparse_mla
from jax_dsa.ops.dense_mla import cuda as dense_cuda
from jax_dsa.ops.indexer import v4_indexer_kl_loss
from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.sparse_mla import cuda as sparse_cuda


def main(only_dense=False, only_indexer=False):
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    s, h, d, k = 150, 128, 576, 2052  # two head groups; K past the last bucket: the wide kernel
    q = jnp.asarray(rng.standard_normal((1, s, h, d)), bf)
    kv = jnp.asarray(rng.standard_normal((1, 3 * s, d)), bf)
    idx = rng.integers(-5, 3 * s + 5, (1, s, k)).astype(np.int32)
    idx[0, 3] = -1  # a row without a valid slot
    idx = jnp.asarray(idx)

    def f(q, kv):
        out, lse = sparse_mla(q, kv, idx, sm_scale=0.05, implementation="cuda")
        return jnp.sum(out.astype(jnp.float32)) + 0 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    if not (only_dense or only_indexer):
        jax.block_until_ready(jax.jit(jax.grad(f, (0, 1)))(q, kv))
        lse = sparse_mla(q, kv, idx, sm_scale=0.05, implementation="cuda")[1]
        jax.block_until_ready(sparse_cuda.cuda_target(q, kv, idx, lse, sm_scale=0.05))

    seg = (np.arange(s) >= 70).astype(np.int32)[None]
    pos = (np.arange(s) - 70 * seg[0])[None].astype(np.int32)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    out, lse_d = dense_mla(q[:, :, :64], kv[:, :s], sm_scale=0.05, implementation="cuda", **kw)

    iq = jnp.asarray(rng.standard_normal((1, s, 32, 128)), bf)
    ik = jnp.asarray(rng.standard_normal((1, s, 128)), bf)
    w = jnp.asarray(rng.standard_normal((1, s, 32)) * 0.02, jnp.float32)
    top, top_scores = indexer_topk(iq, ik, w, topk=64, return_scores=True, implementation="cuda",
                                   **kw)
    qm, kvm = q[:, :, :64], kv[:, :s]
    lse_m = sparse_mla(qm, kvm, top, sm_scale=0.05, implementation="cuda")[1]
    cases = [(lse_m, top_scores)] if only_indexer else [(None, None), (lse_m, None),
                                                        (lse_m, top_scores)]
    for given, scores in () if only_dense else cases:
        loss = lambda iq, ik, w, given=given, scores=scores: indexer_kl_loss(
            iq, ik, w, qm, kvm, sm_scale=0.05, indices=top, attention_lse=given,
            index_scores=scores, implementation="cuda", **kw)
        jax.block_until_ready(jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(iq, ik, w))
    dense_cuda.BWD_CHUNK, kl_loss_cuda.CHUNK = 64, 64
    lse_v4 = lse_d + 1.0  # window and sink mass beside the compressed entries
    loss = lambda iq, ik, w: v4_indexer_kl_loss(iq, ik, w, qm, kvm, lse_v4, sm_scale=0.05,
                                                implementation="cuda", **kw)
    jax.block_until_ready(jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(iq, ik, w))
    if only_indexer:
        print("sanitize launches done", flush=True)
        return
    dense = lambda q, kv: jnp.sum(dense_mla(q, kv, sm_scale=0.05, implementation="cuda",
                                            **kw)[0].astype(jnp.float32))
    jax.block_until_ready(jax.jit(jax.grad(dense, (0, 1)))(qm, kvm))
    for given in (None, lse_d):
        loss = lambda iq, ik, w, given=given: indexer_kl_loss(
            iq, ik, w, qm, kvm, sm_scale=0.05, attention_lse=given, implementation="cuda", **kw)
        jax.block_until_ready(jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(iq, ik, w))
    print("sanitize launches done", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--only-dense", action="store_true")
    only.add_argument("--only-indexer", action="store_true")
    a = ap.parse_args()
    main(only_dense=a.only_dense, only_indexer=a.only_indexer)
