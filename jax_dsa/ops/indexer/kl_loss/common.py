"""Pieces the two indexer KL losses (``indexer_kl_loss``, ``v4_indexer_kl_loss``) share: their
argument checks and one query block's support, index scores and attention logits."""

from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.ops.blocks import default_block_q, einsum
from jax_dsa.ops.checks import check_int, check_positions, check_sm_scale, int32_slots
from jax_dsa.ops.indexer.scores import check_indexer, dense_scores, sparse_scores
from jax_dsa.ops.visibility import visibility


def block_support_and_logits(iqb, iwb, pb, sb, qb, ib, okb, ik, kv, kv_pos, kv_seg, scale, acc):
    """One query block of the KL losses: the support (visible keys, or the block's valid visible
    slots ``ib``), the index scores over it and the main attention's scaled logits ``[b, H, n]``."""
    if ib is None:
        support = visibility(pb, kv_pos, sb, kv_seg)
        score = dense_scores(iqb, ik, iwb, acc)
        logits = einsum("qhd,sd->qhs", qb, kv, acc) * jnp.asarray(scale, acc)
    else:
        valid = (ib >= 0) & (ib < kv.shape[0])
        safe = jnp.where(valid, ib, 0)
        support = valid & (kv_pos[safe] <= pb[:, None])
        if sb is not None:
            support = support & (kv_seg[safe] == sb[:, None])
        # Slots outside the support gather zeros (their gradients are dropped): a key the query
        # cannot see is never read, so a NaN in the query never reaches that key's gradient.
        rows = jnp.where(support, ib, kv.shape[0])
        score = sparse_scores(iqb, ik.at[rows].get(mode="fill", fill_value=0), iwb, acc,
                              support & okb[:, None])
        kv_rows = kv.at[rows].get(mode="fill", fill_value=0)
        logits = einsum("qhd,qkd->qhk", qb, kv_rows, acc) * jnp.asarray(scale, acc)
    return support & okb[:, None], score, logits


def check_kl_args(name, index_q, index_k, index_weights, q, kv, sm_scale, indices, block_q,
                   q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Argument checks shared by the indexer KL losses (``indexer_kl_loss`` and the V4 one):
    returns ``batch, S_q, index H, S_kv, H, indices, block_q`` and the checked positions and
    segment ids. Raises as the losses document."""
    check_sm_scale(name, sm_scale, "the main attention's softmax scale")
    batch, s_q, h_i, s_kv = check_indexer(
        name, index_q, index_k, index_weights, names=("index_q", "index_k", "index_weights")
    )
    nbd = len(batch)
    if q.ndim != nbd + 3 or q.shape[:-2] != batch + (s_q,):
        raise ValueError(
            f"{name}: q must be [..., S_q, H, D_qk] = {batch + (s_q,)} + (H, D_qk) like index_q, "
            f"got shape {q.shape}"
        )
    h, d_qk = q.shape[-2:]
    if kv.shape != batch + (s_kv, d_qk):
        raise ValueError(
            f"{name}: kv must be [..., S_kv, D_qk] = {batch + (s_kv, d_qk)}, got shape {kv.shape}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype != kv.dtype:
        raise TypeError(f"{name}: q and kv must share one float dtype, got {q.dtype}, {kv.dtype}")
    visibility = check_positions(
        name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, batch + (s_q,),
        batch + (s_kv,),
    )
    if indices is not None:
        indices = int32_slots(indices)
        if indices.ndim != nbd + 2 or indices.shape[:-1] != batch + (s_q,):
            raise ValueError(
                f"{name}: indices must be [..., S_q, K] = {batch + (s_q,)} + (K,), got shape "
                f"{indices.shape}"
            )
        if indices.shape[-1] < 1:
            raise ValueError(f"{name}: indices must have at least one slot (K >= 1)")
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"{name}: indices must be an integer array, got {indices.dtype}")
    if block_q is None:
        d_i = index_q.shape[-1]
        if indices is None:
            per_row = (h_i + h) * s_kv
        else:
            per_row = indices.shape[-1] * (h_i + h + d_i + d_qk)
        block_q = default_block_q(s_q, per_row)
    else:
        block_q = check_int(name, "block_q", block_q)
    return batch, s_q, h_i, s_kv, h, indices, block_q, visibility
