"""Which keys a query may see (causal by position, within its document), and the softmax
restricted to them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.checks import check_positions


def visible_mask(q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None):
    """Which keys each query may see: causal by position, and within its own document.

    Key ``s`` is visible to query ``t`` iff ``kv_positions[s] <= q_positions[t]`` and, when
    segment ids are given, ``kv_segment_ids[s] == q_segment_ids[t]``. With packed documents, give
    per-document positions (or global ones) together with segment ids; queries and keys may be
    different ranges of the sequence (e.g. a context-parallel shard of queries against all keys).

    This materialises the full ``[..., S_q, S_kv]`` mask: use it for small blocks. The indexer
    ops call it one query block at a time.

    Args:
      q_positions: ``[..., S_q]`` integer positions of the queries.
      kv_positions: ``[..., S_kv]`` integer positions of the keys, same batch dims.
      q_segment_ids: optional ``[..., S_q]`` integer document ids of the queries.
      kv_segment_ids: optional ``[..., S_kv]`` integer document ids of the keys; given together
        with ``q_segment_ids``.

    Returns:
      ``[..., S_q, S_kv]`` bool.

    Raises:
      ValueError: ranks or batch dims that disagree, or only one of the segment ids given.
      TypeError: non-integer positions or segment ids.
    """
    q_positions, kv_positions, q_segment_ids, kv_segment_ids = check_positions(
        "visible_mask", q_positions, kv_positions, q_segment_ids, kv_segment_ids, None, None
    )
    return visibility(q_positions, kv_positions, q_segment_ids, kv_segment_ids)


def visibility(q_pos, kv_pos, q_seg, kv_seg):
    mask = kv_pos[..., None, :] <= q_pos[..., :, None]
    if q_seg is not None:
        mask = mask & (kv_seg[..., None, :] == q_seg[..., :, None])
    return mask


def masked_log_softmax(x, mask):
    """Log-softmax over the last axis restricted to ``mask``; 0 outside it and on empty rows."""
    mask = jnp.broadcast_to(mask, x.shape)
    m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    z = jnp.where(mask, x - m, 0)
    total = jnp.sum(jnp.where(mask, jnp.exp(z), 0), axis=-1, keepdims=True)
    lse = jnp.log(jnp.where(total > 0, total, 1))
    return jnp.where(mask, z - lse, 0)
