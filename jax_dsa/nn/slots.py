"""Slot lists for ``sparse_mla`` that do not come from the indexer: every visible key.

Dense warm-up (DeepSeek-V3.2 paper §2.1) keeps full causal attention. The layers run it through
:func:`jax_dsa.dense_mla` (positions and segment ids, no slot list); :func:`dense_indices` is the
equivalent ``sparse_mla`` slot list, ``[S_q, S_kv]`` int32 (64 GiB at 128K tokens): a helper for
tests and small sequences, which nothing in :mod:`jax_dsa.nn` calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.indexer import visible_mask
from jax_dsa.sharding.constraints import whole


def dense_indices(q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None):
    """Every key visible to each query, ascending, ``-1`` padded: ``[..., S_q, S_kv]`` int32.

    Visibility is :func:`jax_dsa.ops.indexer.visible_mask` (``kv_pos <= q_pos``, same segment).
    Valid slots come first (a prefix, as the cuDNN backward's ``topk_length`` convention wants),
    so ``count(indices >= 0)`` is the row's slot count. Costs a sort of ``[S_q, S_kv]`` keys:
    meant for tests and short sequences; :func:`jax_dsa.dense_mla` computes
    ``sparse_mla(q, kv, dense_indices(...))`` without it.

    Args:
      q_positions, kv_positions: ``[..., S_q]`` / ``[..., S_kv]`` integer positions.
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` document ids.

    Returns:
      ``[..., S_q, S_kv]`` int32 key row ids with ``-1`` for padding. No gradient.
    """
    # every query row looks at every key: on Explicit axes the key side comes whole along the
    # sequence (a [S_q, S_kv] mask cannot be split on the same axis twice)
    kv_positions, kv_segment_ids = whole(kv_positions, -1), whole(kv_segment_ids, -1)
    vis = visible_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    s_kv = vis.shape[-1]
    key = jnp.where(vis, jnp.arange(s_kv, dtype=jnp.int32), s_kv)
    key = jnp.sort(key, axis=-1)
    return jax.lax.stop_gradient(jnp.where(key == s_kv, -1, key).astype(jnp.int32))
