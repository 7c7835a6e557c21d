"""``sparse_dense_mla``: one softmax over a slot list into ``kv`` and every visible row of a
second key set ``kv_dense``.

DeepSeek V4's HCA layers (and CSA's dense warm-up) attend to a sliding window of raw rows and to
every visible compressed entry (DeepSeek-V4 report; transformers' ``DeepseekV4Attention``). As
one :func:`jax_dsa.sparse_mla` call this needs a slot list of ``window + S / m`` per query
(``[S, S / 4]`` for dense CSA); here the window goes through :func:`jax_dsa.sparse_mla` and the
compressed rows through :func:`jax_dsa.dense_mla`, without a list, and the two are merged by
their log-sum-exps::

    out = exp(lse_1 - L) * out_1 + exp(lse_2 - L) * out_2,   L = log(e^lse_1 + e^lse_2 + e^sink)

The backward runs each op's backward with the merged ``out`` and ``lse`` (the whole row's
softmax): each then yields exactly its keys' share of ``dq`` and ``dkv``, as the chunks of
``dense_mla``'s ``"cuda"`` backward do; the sink's gradient, which depends on no key, is formed
here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops import determinism
from jax_dsa.ops.blocks import acc_dtype
from jax_dsa.ops.dense_mla import op as dense_op
from jax_dsa.ops.dense_mla import sharding as dense_sharding
from jax_dsa.ops.sparse_mla import op as sparse_op
from jax_dsa.ops.sparse_mla import sharding as sparse_sharding


def sparse_dense_mla(q, kv, indices, kv_dense, *, sm_scale, d_v, q_positions, kv_dense_positions,
                     q_segment_ids=None, kv_dense_segment_ids=None, attn_sink=None,
                     topk_length=None, implementation=None, deterministic=None):
    """Attention of each query to its slots in ``kv`` and to every visible row of ``kv_dense``,
    in one softmax (with an optional per-head sink).

    Equal to :func:`jax_dsa.sparse_mla` over ``concat([kv, kv_dense])`` with each query's slots
    followed by the indices (offset by ``S_kv``) of its visible ``kv_dense`` rows, without that
    list: memory linear in ``S_dense``.

    Args:
      q: ``[..., S_q, H, D_qk]`` float queries.
      kv: ``[..., S_kv, D_qk]`` latent rows of the slots, q's dtype.
      indices: ``[..., S_q, K]`` integer slots into ``kv`` (``-1`` / out of range: invalid), as
        for :func:`jax_dsa.sparse_mla`; ``topk_length`` as there.
      kv_dense: ``[..., S_dense, D_qk]`` latent rows every query sees where visible, q's dtype.
      q_positions, kv_dense_positions: ``[..., S_q]`` / ``[..., S_dense]`` integer positions;
        row ``s`` of ``kv_dense`` is visible to query ``t`` iff ``kv_dense_positions[s] <=
        q_positions[t]`` and, with segment ids, ``kv_dense_segment_ids[s] == q_segment_ids[t]``
        (as for :func:`jax_dsa.dense_mla`).
      sm_scale, d_v, attn_sink, implementation, deterministic: as for
        :func:`jax_dsa.sparse_mla` (the implementation is given to both ops; each uses its
        default order where it lacks it).

    Returns:
      ``(out [..., S_q, H, d_v]`` in q's dtype, ``lse [..., S_q, H]`` float32``)``: natural log of
      the sum over both key sets (sink excluded), ``+inf`` and ``out = 0`` where a row sees no
      key. Gradients for ``q``, ``kv``, ``kv_dense`` and ``attn_sink``; ``lse`` takes none.

    Raises:
      ValueError, TypeError: as :func:`jax_dsa.sparse_mla` (the slot part) and
        :func:`jax_dsa.dense_mla` (the dense part: its ``kv`` is ``kv_dense``) raise for their
        arguments, the message saying which part.
      NotImplementedError: the requested implementations are not built in this install.
    """
    deterministic = determinism.resolve("sparse_dense_mla", deterministic)
    try:
        batch, sp, sp_config = sparse_op.prepare(
            q, kv, indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
            topk_length=topk_length, implementation=sparse_op.REGISTRY.restrict(implementation),
            deterministic=deterministic)
    except (TypeError, ValueError) as e:
        raise type(e)(f"sparse_dense_mla: the slot part: {e}") from None
    try:
        _, de, de_config = dense_op.prepare(
            q, kv_dense, sm_scale=sm_scale, d_v=d_v, q_positions=q_positions,
            kv_positions=kv_dense_positions, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_dense_segment_ids, attn_sink=attn_sink,
            implementation=dense_op.REGISTRY.restrict(implementation),
            deterministic=deterministic)
    except (TypeError, ValueError) as e:
        raise type(e)(f"sparse_dense_mla: the dense part (its kv is kv_dense, its kv_positions "
                      f"kv_dense_positions): {e}") from None
    q3, kv3, idx, sink, lengths = sp
    _, kvd, q_pos, kv_pos, q_seg, kv_seg, _ = de
    out, lse = _merged(q3, kv3, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg,
                       sink.astype(acc_dtype(q3)), sp_config, de_config)
    s_q, h = q3.shape[1:3]
    return out.reshape(batch + (s_q, h, d_v)), lse.reshape(batch + (s_q, h))


def _has(lse):
    return lse != jnp.inf  # +inf: no key in that part; NaN (a poisoned row) is not empty


def _forward(q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, sp_config,
             de_config):
    no_sink = jnp.full(sink.shape, -jnp.inf, sink.dtype)
    o1, l1, _ = sparse_sharding.forward(q, kv, idx, no_sink, lengths, sp_config)
    o2, l2 = dense_sharding.forward(q, kvd, q_pos, kv_pos, q_seg, kv_seg, no_sink, de_config)
    a1 = jnp.where(_has(l1), l1, -jnp.inf)
    a2 = jnp.where(_has(l2), l2, -jnp.inf)
    lse = jnp.logaddexp(a1, a2)  # sink-free; -inf: no key at all
    has = lse != -jnp.inf  # NaN (poisoned) reaches out and lse
    full = jnp.where(has, jnp.logaddexp(lse, sink), 0)
    w1 = jnp.where(has, jnp.exp(a1 - full), 0)[..., None]
    w2 = jnp.where(has, jnp.exp(a2 - full), 0)[..., None]
    acc = acc_dtype(q)
    out = (w1 * o1.astype(acc) + w2 * o2.astype(acc)).astype(q.dtype)
    return out, jnp.where(has, lse, jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _merged(q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, sp_config, de_config):
    return _forward(q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, sp_config,
                    de_config)


def _fwd_rule(q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, sp_config,
              de_config):
    out, lse = _forward(q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, sp_config,
                        de_config)
    return (out, lse), (q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse)


def _bwd_rule(sp_config, de_config, residuals, cotangents):
    q, kv, idx, lengths, kvd, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse = residuals
    dout = cotangents[0]  # lse takes no gradient
    has = _has(lse)
    # Both parts see the whole row's softmax: the sink folded into lse, none of their own.
    folded = jnp.where(has, jnp.logaddexp(lse, sink), jnp.inf)
    no_sink = jnp.full(sink.shape, -jnp.inf, sink.dtype)
    dq1, dkv, _ = sparse_sharding.backward(q, kv, idx, no_sink, lengths, out, folded, dout,
                                           sp_config)
    dq2, dkvd, _ = dense_sharding.backward(q, kvd, q_pos, kv_pos, q_seg, kv_seg, no_sink, out,
                                           folded, dout, de_config)
    acc = acc_dtype(q)
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)  # rowsum(dout * out)
    # exp(sink - L) as a sigmoid: finite (1) for a sink of +inf.
    d_sink = -jnp.sum(jnp.where(has, jax.nn.sigmoid(sink - lse), 0) * delta, axis=(0, 1))
    dq = (dq1.astype(acc) + dq2.astype(acc)).astype(q.dtype)
    return (dq, dkv, None, None, dkvd, None, None, None, None, d_sink.astype(sink.dtype))


_merged.defvjp(_fwd_rule, _bwd_rule)
