"""The ``"xla"`` implementation of ``indexer_topk``: pure JAX, any platform, the oracle.

Queries are processed in blocks (``lax.map``) so that the largest temporary is one block's
``[block_q, index_n_heads, S_kv]`` scores: memory grows linearly in the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.blocks import acc_dtype, blocks_of, unblock
from jax_dsa.ops.indexer.scores import dense_scores
from jax_dsa.ops.visibility import visibility
from jax_dsa.ops.indexer.topk.config import TopkConfig
from jax_dsa.ops.registry import Implementation, always


def forward(q, k, weights, q_pos, kv_pos, q_seg, kv_seg, k_scale, config: TopkConfig):
    """``[NB, S_q, config.topk]`` int32 key indices on flattened batches (segment ids may be
    ``None``): descending score, ties to the lower key index, ``-1`` past the visible keys;
    with ``config.scores`` also their scores (``-inf`` on ``-1``). ``k_scale [NB, S_kv]`` (fp8
    ``q``/``k``, else ``None``) multiplies each key's score."""
    if k_scale is None:
        acc = acc_dtype(q, k, weights)
    else:  # fp8 values are exact in float32: exact products
        acc = acc_dtype(weights)
        q, k = q.astype(acc), k.astype(acc)

    def one(q, k, w, q_pos, kv_pos, q_seg, kv_seg, k_scale):
        def block(xs):
            qb, wb, pb, sb = xs
            vis = visibility(pb, kv_pos, sb, kv_seg)
            score = dense_scores(qb, k, wb, acc)
            if k_scale is not None:
                score = score * k_scale.astype(acc)
            # top_k orders -0.0 below +0.0: make every zero +0.0 so that zeros tie. Visible
            # scores stay above -inf so that an invisible key never outranks a visible one.
            score = jnp.where(score == 0, jnp.zeros((), acc), score)
            score = jnp.where(vis, jnp.maximum(score, jnp.finfo(acc).min), -jnp.inf)
            vals, idx = jax.lax.top_k(score, config.topk)
            return jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32), vals

        idx, vals = jax.lax.map(block, blocks_of(config.block_q, q, w, q_pos, q_seg))
        return unblock(idx, q.shape[0]), unblock(vals, q.shape[0])  # local rows over a mesh

    idx, vals = jax.vmap(one)(q, k, weights, q_pos, kv_pos, q_seg, kv_seg, k_scale)
    return (idx, vals) if config.scores else (idx,)


IMPLEMENTATION = Implementation("xla", always, forward)
