"""Pure-JAX dense MLA forward and backward (the ``"xla"`` implementation and the oracle).

One batch element at a time: ``q [S_q, H, D_qk]``, ``kv [S_kv, D_qk]``, positions and segment
ids. Queries are processed in blocks of ``block_q`` rows, each block against every key with the
visibility mask (``kv_pos <= q_pos``, same segment) built for that block only, so the largest
temporaries are one block's ``[block_q, H, S_kv]`` logits and probabilities: memory grows
linearly in the sequence, never with ``S_q * S_kv``.

Math: the same as :mod:`jax_dsa.ops.sparse_mla.xla` with every visible key as a slot (FlashMLA's
sparse prefill reference, deepseek-ai/FlashMLA ``tests/ref.py``, the sink in the denominator).
The backward is FlashAttention-2's (Dao, 2023, arXiv:2307.08691, Alg. 2): the probabilities are
recomputed per block from ``q``, ``kv`` and the saved ``lse``; ``dkv`` is accumulated in float32
over the query blocks; the sink adds ``-p_sink * rowsum(dout * out)`` to ``d_attn_sink``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops import blocks
from jax_dsa.ops.blocks import acc_dtype, blocks_of, einsum, unblock
from jax_dsa.ops.dense_mla.config import Config
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Implementation


_MAX_BLOCK_Q = 128


def default_block_q(s_q: int, h: int, s_kv: int) -> int:
    """Largest power of two <= 128 with ``block_q * h * s_kv`` within the element budget, no
    larger than the smallest power of two covering ``s_q``."""
    return blocks.default_block_q(s_q, h * max(s_kv, 1), _MAX_BLOCK_Q)


def _row_blocks(block_q, q_pos, q_seg):
    """Blocked query positions, segment ids (or None) and a row mask that drops padding rows."""
    ok = jnp.ones(q_pos.shape, jnp.bool_)
    return blocks_of(block_q, q_pos, q_seg, ok)


def _finite_rows(x):
    """``x`` with its non-finite rows (last axis) zeroed, and which rows were finite.

    The contractions over keys (``p @ v``, ``ds @ kv``) and over queries (``dsᵀ q``, ``pᵀ dout``)
    multiply masked zeros by every row, and ``0 * NaN`` is NaN: they run on the zeroed rows, and
    a non-finite row reaches only the entries that read it through :func:`_masked_logits`."""
    ok = jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(ok[..., None], x, 0), ok


def _masked_logits(qb, q_ok, kv, kv_ok, vis, sm_scale, acc):
    """One block's ``[block_q, H, S_kv]`` scaled logits: ``-inf`` where a key is not visible,
    NaN where a visible key or the query holds a NaN or inf (it reaches out and lse)."""
    s = einsum("qhd,sd->qhs", qb, kv, acc) * jnp.asarray(sm_scale, acc)
    s = jnp.where(q_ok[:, :, None] & kv_ok[None, None, :], s, jnp.nan)
    return jnp.where(vis[:, None, :], s, -jnp.inf)


def _visible(pb, sb, okb, kv_pos, kv_seg):
    vis = (kv_pos[None, :] <= pb[:, None]) & okb[:, None]
    if sb is not None:
        vis = vis & (kv_seg[None, :] == sb[:, None])
    return vis


def forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, attn_sink, *, sm_scale, d_v, block_q):
    """One batch element: ``out [S_q, H, d_v]`` (q's dtype) and ``lse [S_q, H]`` (float32,
    sink-free, ``+inf`` for a row without a visible key, whose ``out`` is 0; NaN for a row that
    reads a NaN or inf)."""
    s_q, h, _ = q.shape
    s_kv = kv.shape[0]
    if s_kv == 0:  # no key is visible
        return jnp.zeros((s_q, h, d_v), q.dtype), jnp.full((s_q, h), jnp.inf, jnp.float32)
    acc = acc_dtype(q)
    sink = attn_sink.astype(acc)
    kv, kv_ok = _finite_rows(kv)
    v = kv[:, :d_v]

    def block(args):
        qb, pb, sb, okb = args
        qb, q_ok = _finite_rows(qb)
        vis = _visible(pb, sb, okb, kv_pos, kv_seg)
        s = _masked_logits(qb, q_ok, kv, kv_ok, vis, sm_scale, acc)
        mx = jnp.max(s, axis=-1)  # -inf for a row without a visible key, NaN if poisoned
        has_key = jnp.broadcast_to(jnp.any(vis, axis=-1)[:, None], mx.shape)
        m = jnp.where(has_key, mx, 0)
        e = jnp.exp(s - m[..., None])
        l = jnp.sum(e, axis=-1)
        o = einsum("qhs,sd->qhd", e, v.astype(acc), acc)
        # Sink: one more term exp(sink) in the denominator, no value row.
        denom = l + jnp.exp(sink[None, :] - m)
        o = jnp.where(has_key[..., None], o / jnp.where(has_key, denom, 1)[..., None], 0)
        lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1)), jnp.inf)
        return o.astype(q.dtype), lse.astype(jnp.float32)

    pb, sb, okb = _row_blocks(block_q, q_pos, q_seg)
    out, lse = jax.lax.map(block, (blocks_of(block_q, q)[0], pb, sb, okb))
    return unblock(out, s_q), unblock(lse, s_q)


def backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, attn_sink, out, lse, dout, *, sm_scale, d_v,
             block_q):
    """One batch element: ``dq`` (q's dtype), ``dkv`` (kv's dtype; K and V parts summed, float32
    accumulation) and ``d_attn_sink`` (float32 or wider)."""
    s_q, h, d_qk = q.shape
    s_kv = kv.shape[0]
    acc = acc_dtype(q)
    if s_kv == 0:  # no key is visible: no gradient
        return jnp.zeros_like(q), jnp.zeros_like(kv), jnp.zeros((h,), acc)
    sink = attn_sink.astype(acc)
    scale = jnp.asarray(sm_scale, acc)
    kv, kv_ok = _finite_rows(kv)
    v = kv[:, :d_v]

    def block(carry, args):
        dkv, dsink = carry
        qb, pb, sb, okb, ob, dob, lseb = args
        qb, q_ok = _finite_rows(qb)
        vis = _visible(pb, sb, okb, kv_pos, kv_seg)
        s = _masked_logits(qb, q_ok, kv, kv_ok, vis, sm_scale, acc)
        lseb = lseb.astype(acc)
        has_key = (lseb != jnp.inf) & okb[:, None]  # NaN (poisoned) is not empty
        lse_full = jnp.where(has_key, jnp.logaddexp(lseb, sink[None, :]), jnp.inf)
        vis3 = vis[:, None, :]
        p = jnp.where(vis3, jnp.exp(s - lse_full[..., None]), 0)  # 0 on invisible keys
        # exp(sink - lse_full) as a sigmoid: finite (1) for a sink of +inf, where it is inf - inf.
        p_sink = jnp.where(has_key, jax.nn.sigmoid(sink[None, :] - lseb), 0)
        dob = jnp.where(okb[:, None, None], dob.astype(acc), 0)
        delta = jnp.sum(dob * ob.astype(acc), axis=-1)  # rowsum(dout * out)
        dob, do_ok = _finite_rows(dob)
        dp = jnp.where(do_ok[..., None], einsum("qhd,sd->qhs", dob, v, acc), jnp.nan)
        ds = jnp.where(vis3, p * (dp - delta[..., None]), 0)
        dqb = einsum("qhs,sd->qhd", ds, kv, acc) * scale
        dkv = dkv + einsum("qhs,qhd->sd", ds, qb, acc) * scale
        dkv = dkv.at[:, :d_v].add(einsum("qhs,qhd->sd", p, dob, acc))
        dsink = dsink - jnp.sum(p_sink * delta, axis=0)
        return (dkv, dsink), dqb.astype(q.dtype)

    pb, sb, okb = _row_blocks(block_q, q_pos, q_seg)
    qb, ob, dob, lb = blocks_of(block_q, q, out, dout, lse)
    xs = (qb, pb, sb, okb, ob, dob, lb)
    init = (jnp.zeros((s_kv, d_qk), acc), jnp.zeros((h,), acc))
    (dkv, dsink), dq = jax.lax.scan(block, init, xs)
    return unblock(dq, s_q), dkv.astype(kv.dtype), dsink


def _forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config: Config):
    fwd = functools.partial(forward, sm_scale=config.sm_scale, d_v=config.d_v,
                            block_q=config.block_q)
    seg_axis = None if q_seg is None else 0
    return jax.vmap(fwd, in_axes=(0, 0, 0, 0, seg_axis, seg_axis, None))(
        q, kv, q_pos, kv_pos, q_seg, kv_seg, sink)


def _backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout, config: Config):
    bwd = functools.partial(backward, sm_scale=config.sm_scale, d_v=config.d_v,
                            block_q=config.block_q)
    seg_axis = None if q_seg is None else 0
    dq, dkv, dsink = jax.vmap(bwd, in_axes=(0, 0, 0, 0, seg_axis, seg_axis, None, 0, 0, 0))(
        q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout.astype(out.dtype))
    return dq, dkv, jnp.sum(dsink, axis=0).astype(sink.dtype)


IMPLEMENTATION = Implementation("xla", determinism.xla_supported, _forward, _backward)
