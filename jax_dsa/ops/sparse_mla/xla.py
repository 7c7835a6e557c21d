"""Pure-JAX sparse MLA forward and backward (the ``"xla"`` implementation and the oracle).

One batch element at a time: ``q [S_q, H, D_qk]``, ``kv [S_kv, D_qk]``, ``indices [S_q, K]``.
Queries are processed in blocks of ``block_q`` rows so that the gathered rows
(``[block_q, K, D_qk]``) and the logits (``[block_q, H, K]``) are the largest temporaries: memory
grows linearly in S_q, never with S_q * K * D_qk or S_q * H * S_kv.

Math: FlashMLA's sparse prefill (deepseek-ai/FlashMLA, ``tests/ref.py``) with the attention sink
in the denominator, and the FlashAttention-2 backward (Dao, 2023, arXiv:2307.08691, Alg. 2) over
the gathered rows, the sink adding ``-p_sink * rowsum(dout * out)`` to ``d_attn_sink``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops import blocks
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Implementation
from jax_dsa.ops.sparse_mla.config import Config

# At most 64 query rows a block: one block's gathered [block_q, K, D_qk] rows are the largest
# temporary.
_MAX_BLOCK_Q = 64


def default_block_q(s_q: int, topk: int, d_qk: int) -> int:
    """Largest power of two <= 64 whose gathered block stays under the element budget."""
    return blocks.default_block_q(s_q, topk * d_qk, _MAX_BLOCK_Q)


def _valid_and_safe(idx, length, s_kv):
    """Slot validity and gather rows: invalid slots point past the end (read as 0, dropped on scatter)."""
    pos = jnp.arange(idx.shape[-1], dtype=jnp.int32)
    valid = (idx >= 0) & (idx < s_kv) & (pos < length[:, None])
    return valid, jnp.where(valid, idx, s_kv)


def _logits(qb, rows, valid, sm_scale, acc):
    s = jnp.einsum("qhd,qkd->qhk", qb.astype(acc), rows.astype(acc)) * jnp.asarray(sm_scale, acc)
    # A NaN or inf that a query reads (in its q or a selected row) makes the logit NaN whatever
    # its sign, so that it reaches out and lse (the op's convention for poisoned inputs).
    poisoned = (~jnp.all(jnp.isfinite(qb), axis=-1)[:, :, None]
                | ~jnp.all(jnp.isfinite(rows), axis=-1)[:, None, :])
    s = jnp.where(poisoned, jnp.nan, s)
    return jnp.where(valid[:, None, :], s, -jnp.inf)


def forward(q, kv, indices, attn_sink, topk_length, *, sm_scale, d_v, block_q):
    """Returns ``out [S_q, H, d_v]`` (q's dtype), ``lse [S_q, H]`` (float32, sink-free) and
    ``max_logits [S_q, H]`` (float32: ``sm_scale * max q.k`` over the valid slots, sink-free,
    -inf for a row without one). Callers that drop ``max_logits`` lose nothing: it is the row
    maximum the online softmax needs anyway, and XLA removes the unused loop output."""
    s_q, h, _ = q.shape
    s_kv = kv.shape[0]
    if s_kv == 0:  # every slot is invalid
        return (jnp.zeros((s_q, h, d_v), q.dtype), jnp.full((s_q, h), jnp.inf, jnp.float32),
                jnp.full((s_q, h), -jnp.inf, jnp.float32))
    acc = blocks.acc_dtype(q)
    sink = attn_sink.astype(acc)

    def block(args):
        qb, ib, lb = args
        valid, safe = _valid_and_safe(ib, lb, s_kv)
        rows = kv.at[safe].get(mode="fill", fill_value=0)
        s = _logits(qb, rows, valid, sm_scale, acc)
        max_logits = jnp.max(s, axis=-1)  # invalid slots are -inf: -inf for an empty row
        # Empty means no valid slot; a NaN maximum (a poisoned row) is not empty.
        has_slot = jnp.broadcast_to(jnp.any(valid, axis=-1)[:, None], max_logits.shape)
        m = jnp.where(has_slot, max_logits, 0)
        e = jnp.exp(s - m[..., None])
        l = jnp.sum(e, axis=-1)
        o = jnp.einsum("qhk,qkd->qhd", e, rows[..., :d_v].astype(acc))
        # Sink: one more term exp(sink) in the denominator, no value row.
        denom = l + jnp.exp(sink[None, :] - m)
        o = jnp.where(has_slot[..., None], o / jnp.where(has_slot, denom, 1)[..., None], 0)
        lse = jnp.where(has_slot, m + jnp.log(jnp.where(has_slot, l, 1)), jnp.inf)
        return o.astype(q.dtype), lse.astype(jnp.float32), max_logits.astype(jnp.float32)

    out, lse, max_logits = jax.lax.map(block, blocks.blocks_of(block_q, q, indices, topk_length))
    return (blocks.unblock(out, s_q), blocks.unblock(lse, s_q),
            blocks.unblock(max_logits, s_q))


def backward(q, kv, indices, attn_sink, topk_length, out, lse, dout, *, sm_scale, d_v, block_q):
    """Returns ``dq`` (q's dtype), ``dkv`` (kv's dtype; K and V parts summed) and ``d_attn_sink``.

    Recomputes the probabilities from ``lse``; ``dkv`` is accumulated by scatter-add over the
    query blocks (duplicate slots add up), ``d_attn_sink`` in the sink's dtype.
    """
    s_q, h, d_qk = q.shape
    s_kv = kv.shape[0]
    if s_kv == 0:  # every slot is invalid: no gradient
        return jnp.zeros_like(q), jnp.zeros_like(kv), jnp.zeros_like(attn_sink)
    acc = blocks.acc_dtype(q)
    sink = attn_sink.astype(acc)
    scale = jnp.asarray(sm_scale, acc)

    def block(carry, args):
        dkv, dsink = carry
        qb, ib, lb, ob, dob, lseb = args
        valid, safe = _valid_and_safe(ib, lb, s_kv)
        rows = kv.at[safe].get(mode="fill", fill_value=0).astype(acc)
        s = _logits(qb, rows, valid, sm_scale, acc)
        has_slot = lseb != jnp.inf  # +inf marks an empty row; NaN (poisoned) is not empty
        lse_full = jnp.where(has_slot, jnp.logaddexp(lseb.astype(acc), sink[None, :]), jnp.inf)
        p = jnp.where(valid[:, None, :], jnp.exp(s - lse_full[..., None]), 0)
        # exp(sink - lse_full) as a sigmoid: finite (1) for a sink of +inf, where it is inf - inf.
        p_sink = jnp.where(has_slot, jax.nn.sigmoid(sink[None, :] - lseb.astype(acc)), 0)
        dob = dob.astype(acc)
        delta = jnp.sum(dob * ob.astype(acc), axis=-1)  # rowsum(dout * out)
        dp = jnp.einsum("qhd,qkd->qhk", dob, rows[..., :d_v])
        ds = jnp.where(valid[:, None, :], p * (dp - delta[..., None]), 0)
        dqb = jnp.einsum("qhk,qkd->qhd", ds, rows) * scale
        d_rows = jnp.einsum("qhk,qhd->qkd", ds, qb.astype(acc)) * scale
        d_rows = d_rows.at[..., :d_v].add(jnp.einsum("qhk,qhd->qkd", p, dob))
        dkv = dkv.at[safe].add(d_rows, mode="drop")
        dsink = dsink - jnp.sum(p_sink * delta, axis=0)
        return (dkv, dsink), dqb.astype(q.dtype)

    init = (jnp.zeros((s_kv, d_qk), acc), jnp.zeros((h,), acc))
    xs = blocks.blocks_of(block_q, q, indices, topk_length, out, dout, lse)
    (dkv, dsink), dq = jax.lax.scan(block, init, xs)
    return blocks.unblock(dq, s_q), dkv.astype(kv.dtype), dsink.astype(attn_sink.dtype)


def _forward(q, kv, indices, sink, lengths, config: Config):
    fwd = functools.partial(forward, sm_scale=config.sm_scale, d_v=config.d_v,
                            block_q=config.block_q)
    return jax.vmap(fwd, in_axes=(0, 0, 0, None, 0))(q, kv, indices, sink, lengths)


def _backward(q, kv, indices, sink, lengths, out, lse, dout, config: Config):
    bwd = functools.partial(backward, sm_scale=config.sm_scale, d_v=config.d_v,
                            block_q=config.block_q)
    dq, dkv, dsink = jax.vmap(bwd, in_axes=(0, 0, 0, None, 0, 0, 0, 0))(
        q, kv, indices, sink, lengths, out, lse, dout.astype(out.dtype))
    return dq, dkv, jnp.sum(dsink, axis=0)


IMPLEMENTATION = Implementation("xla", determinism.xla_supported, _forward, _backward)
