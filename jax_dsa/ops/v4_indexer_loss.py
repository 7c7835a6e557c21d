"""DeepSeek V4's CSA indexer loss: KL from a teacher whose softmax includes the window and sink.

In a V4 CSA layer each query attends, in one softmax, to its sliding window of raw rows, to some
compressed entries and to a per-head sink. The indexer only chooses among the compressed
entries, so its teacher is the attention mass that lands on them, with the window and sink mass
left in the denominator (NVIDIA/Megatron-LM ``dev``: ``csa.py``,
``_compute_indexer_teacher_probabilities`` with ``non_compressed_lse``;
``shared/research/models.md`` §1.4). For query ``t`` with compressed support ``S_t``::

    P_h[t, s] = exp(sm_scale * q[t, h] . kv[s] - attention_lse[t, h])      s in S_t
    p[t, s]   = sum_h P_h[t, s] / sum_{s' in S_t} sum_h P_h[t, s']          (target)
    pI[t, s]  = softmax_{s in S_t}(I[t, s])                                  (indexer)
    KL_t      = sum_{s in S_t} p[t, s] * (log p[t, s] - log pI[t, s])

where ``attention_lse[t, h]`` is the log of the main attention's whole softmax denominator
(window rows, the compressed slots it attended, and ``exp(attn_sink[h])``). A head that puts its
mass on the window or the sink therefore weighs less in the target than one that attends to the
compressed entries; with ``attention_lse`` equal to the per-head log-sum-exp over ``S_t`` alone the
target is the head mean of V3.2's :func:`jax_dsa.ops.indexer.indexer_kl_loss`. Everything runs in
log space, so a compressed mass that underflows float32 does not zero the target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops.indexer import (
    _acc_dtype,
    _blocks_of,
    _check_kl_args,
    _flatten_batch,
    _masked_log_softmax,
    block_support_and_logits,
)
from jax_dsa.sharding import partition


def v4_indexer_kl_loss(
    index_q,
    index_k,
    index_weights,
    q,
    kv,
    attention_lse,
    *,
    sm_scale,
    q_positions,
    kv_positions,
    q_segment_ids=None,
    kv_segment_ids=None,
    indices=None,
    block_q=None,
):
    """Mean over query rows of the KL from the window-and-sink-aware teacher to the indexer.

    The support ``S_t`` is, as in :func:`jax_dsa.ops.indexer.indexer_kl_loss`: every compressed
    entry visible to ``t`` (dense form, ``indices=None``; visibility is
    ``kv_positions[s] <= q_positions[t]`` within the same segment), or the valid visible slots of
    ``indices[t]`` (sparse form: ``0 <= index < S_kv``; ``-1`` marks an invalid slot). Rows with an
    empty support are left out of the mean; the loss is 0 when no row has one.

    ``attention_lse`` must be the log of the softmax denominator of the attention whose heads
    define the teacher: the window, every compressed slot that attention used (a superset of
    ``S_t``) and the sink. From :func:`jax_dsa.sparse_mla`'s outputs:
    ``jnp.logaddexp(lse, attn_sink)``.

    Gradients flow to ``index_q``, ``index_k`` and ``index_weights`` only: ``q``, ``kv`` and
    ``attention_lse`` are wrapped in ``stop_gradient`` (the indexer learns only from this loss).
    Each query block's body is rematerialised in the backward pass.

    Args:
      index_q: ``[..., S_q, index_n_heads, index_head_dim]`` float indexer queries.
      index_k: ``[..., S_kv, index_head_dim]`` float indexer keys of the compressed entries.
      index_weights: ``[..., S_q, index_n_heads]`` float head weights (scale folded in).
      q: ``[..., S_q, H, D]`` float main-attention queries, as given to ``sparse_mla``.
      kv: ``[..., S_kv, D]`` float compressed K = V rows, ``q``'s dtype.
      attention_lse: ``[..., S_q, H]`` float natural-log denominator (see above).
      sm_scale: the main attention's softmax scale (Python number; V4: ``head_dim**-0.5``).
      q_positions, kv_positions: ``[..., S_q]`` / ``[..., S_kv]`` integer positions (for the
        compressed entries: the position of the last token of their window).
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` integer document
        ids (both or neither).
      indices: optional ``[..., S_q, K]`` integer compressed-row ids (the sparse form).
      block_q: query rows per block (Python int >= 1); ``None`` picks one so that a block's
        temporaries stay near 64 MiB.

    Returns:
      A scalar: float32, or float64 when an input is float64 (under x64).

    Raises:
      ValueError: wrong ranks or shapes (named by argument), ``S_kv == 0``, ``block_q < 1``,
        only one of the segment ids given.
      TypeError: ``sm_scale`` not a number; non-float tensors; ``q``/``kv`` dtypes that differ;
        non-integer ``indices``, positions, segment ids or ``block_q``.
    """
    name = "v4_indexer_kl_loss"
    index_q, index_k, index_weights, q, kv, attention_lse = (
        jnp.asarray(x) for x in (index_q, index_k, index_weights, q, kv, attention_lse)
    )
    batch, s_q, h_i, s_kv, h, indices, block_q, (q_pos, kv_pos, q_seg, kv_seg) = _check_kl_args(
        name, index_q, index_k, index_weights, q, kv, sm_scale, indices, block_q, q_positions,
        kv_positions, q_segment_ids, kv_segment_ids)
    if attention_lse.shape != batch + (s_q, h):
        raise ValueError(
            f"{name}: attention_lse must be [..., S_q, H] = {batch + (s_q, h)}, got "
            f"{attention_lse.shape}"
        )
    if not jnp.issubdtype(attention_lse.dtype, jnp.floating):
        raise TypeError(f"{name}: attention_lse must be a float array, got {attention_lse.dtype}")

    acc = _acc_dtype(index_q, index_k, index_weights, q, kv)
    q, kv = jax.lax.stop_gradient(q), jax.lax.stop_gradient(kv)
    lse = jax.lax.stop_gradient(attention_lse).astype(acc)
    scale = float(sm_scale)
    nb = 1
    for n in batch:
        nb *= n
    args = _flatten_batch(batch, index_q, index_k, index_weights, q_pos, kv_pos, q_seg, kv_seg)
    q3 = q.reshape((nb, s_q, h, q.shape[-1]))
    kv3 = kv.reshape((nb, s_kv, q.shape[-1]))
    lse3 = lse.reshape((nb, s_q, h))
    idx3 = None if indices is None else indices.astype(jnp.int32).reshape((nb, s_q, -1))

    def one(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx, layout=partition.Layout()):
        row_ok = jnp.ones((iq.shape[0],), jnp.bool_)

        def block(xs):
            iqb, iwb, pb, sb, qb, lb, ib, okb = xs
            support, score, logits = block_support_and_logits(
                iqb, iwb, pb, sb, qb, ib, okb, ik, kv, kv_pos, kv_seg, scale, acc
            )
            log_pi = _masked_log_softmax(score, support)
            # Per-head probabilities under the full denominator, summed over heads in log space.
            log_ph = jnp.where(support[:, None, :], logits - lb[:, :, None], -jnp.inf)
            log_t = partition.head_logsumexp(log_ph, 1, layout)  # over every head shard
            log_p = _masked_log_softmax(jnp.where(support, log_t, 0), support)
            p = jnp.where(support, jnp.exp(log_p), 0)
            kl = jnp.sum(jnp.where(support, p * (log_p - log_pi), 0), axis=-1)
            has = jnp.any(support, axis=-1)
            return jnp.sum(jnp.where(has, kl, 0)), jnp.sum(has.astype(jnp.int32))

        xs = _blocks_of(block_q, iq, iw, q_pos, q_seg, q, lse, idx, row_ok)
        kl, count = jax.lax.map(jax.checkpoint(block), xs)
        return jnp.sum(kl), jnp.sum(count)

    kl, count = partition.v4_indexer_kl_loss(  # vmap(one), split over the mesh in context
        lambda layout: functools.partial(one, layout=layout), *args, q3, kv3, lse3, idx3
    )
    kl, count = jnp.sum(kl), jnp.sum(count)
    return jnp.where(count > 0, kl / jnp.maximum(count, 1).astype(acc), jnp.zeros((), acc))


__all__ = ["v4_indexer_kl_loss"]
