"""Pieces shared by the lightning-indexer ops: visibility, argument checks, scores, query blocks.

Index score (DeepSeek-V3.2 paper, eq. 1; deepseek-ai/DeepSeek-V3.2-Exp ``inference/model.py``)::

    I[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])

computed in float32 (float64 for float64 inputs). The positive scale factors of the reference
implementations (``index_n_heads**-0.5 * index_head_dim**-0.5``) belong to the caller, inside
``weights``.

Everything is pure JAX, works under ``jit``, ``vmap`` and ``grad``, and takes any number of
leading batch dimensions ``...``. Queries are processed in blocks (``lax.map``) so that the
largest temporary is one block's ``[block_q, index_n_heads, S_kv]`` scores: memory grows linearly
in the sequence length, never with ``S_q * S_kv``. The KL loss's block body is rematerialised
(``jax.checkpoint``) so that the backward pass is bounded the same way.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jax_dsa.ops.mla_args import check_sm_scale


# Elements in one query block's largest temporary (~64 MiB of float32).
BLOCK_ELEMENTS = 1 << 24
MAX_BLOCK_Q = 128

_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------
# Visibility


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


# --------------------------------------------------------------------------------------------
# Shared pieces


def einsum(spec, a, b, acc):
    # HIGHEST: float32 inputs must not be rounded to TF32 on GPUs; 16-bit inputs multiply exactly.
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=acc)


def dense_scores(qb, k, wb, acc):
    """``[B, H_I, D]``, ``[S_kv, D]``, ``[B, H_I]`` -> ``[B, S_kv]`` index scores."""
    dots = einsum("qhd,sd->qhs", qb, k, acc)
    return jnp.sum(jax.nn.relu(dots) * wb.astype(acc)[:, :, None], axis=1)


def sparse_scores(qb, rows, wb, acc):
    """``[B, H_I, D]``, gathered ``[B, K, D]``, ``[B, H_I]`` -> ``[B, K]`` index scores."""
    dots = einsum("qhd,qkd->qhk", qb, rows, acc)
    return jnp.sum(jax.nn.relu(dots) * wb.astype(acc)[:, :, None], axis=1)


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-4  # rows of (near) zeros get the scale of this amax


def quantize_fp8(x):
    """``x`` rounded to ``float8_e4m3fn`` per row of its last axis, with power-of-two scales.

    ``x ~= x_fp8 * scale[..., None]`` where ``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))``
    (``amax`` the row's largest ``|x|``; the UE8M0 scale format): every ``|x / scale|`` is
    at most 448, the division is exact, and the rounding to e4m3 is to nearest even.

    Source: deepseek-ai/DeepSeek-V3.2-Exp ``inference/kernel.py`` (``act_quant`` with
    ``scale_fmt="ue8m0"``), as its ``Indexer`` quantizes q (per head) and k (per token).

    Args:
      x: ``[..., D]`` float array.

    Returns:
      ``(x_fp8 [..., D] float8_e4m3fn, scale [...] float32)``.
    """
    x = x.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), FP8_AMAX_FLOOR)
    # 2 ** ceil(log2(r)) from r's exponent bits (exp2 and log2 are approximations on some
    # backends): r = m 2^e with m in [0.5, 1), so the power is 2^e, or 2^(e-1) when m = 0.5.
    m, e = jnp.frexp(amax / FP8_MAX)
    scale = jnp.ldexp(jnp.ones_like(amax), jnp.where(m == 0.5, e - 1, e))
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def masked_log_softmax(x, mask):
    """Log-softmax over the last axis restricted to ``mask``; 0 outside it and on empty rows."""
    mask = jnp.broadcast_to(mask, x.shape)
    m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    z = jnp.where(mask, x - m, 0)
    total = jnp.sum(jnp.where(mask, jnp.exp(z), 0), axis=-1, keepdims=True)
    lse = jnp.log(jnp.where(total > 0, total, 1))
    return jnp.where(mask, z - lse, 0)


def acc_dtype(*xs):
    return jnp.promote_types(jnp.result_type(*(x.dtype for x in xs)), jnp.float32)


def default_block_q(s_q, per_row):
    """Largest power of two <= MAX_BLOCK_Q with ``block * per_row <= BLOCK_ELEMENTS``, no more
    than the smallest power of two covering ``s_q``."""
    block = MAX_BLOCK_Q
    while block > 1 and block * per_row > BLOCK_ELEMENTS:
        block //= 2
    while block > 1 and block // 2 >= s_q:
        block //= 2
    return block


def flatten_batch(batch, q, k, w, q_pos, kv_pos, q_seg, kv_seg):
    nb = 1
    for n in batch:
        nb *= n
    nbd = len(batch)

    def flat(x):
        return None if x is None else x.reshape((nb,) + x.shape[nbd:])

    return tuple(flat(x) for x in (q, k, w, q_pos, kv_pos, q_seg, kv_seg))


def blocks_of(block_q, *xs):
    """Each ``[S_q, ...]`` array -> ``[n_blocks, block_q, ...]``; ``None`` stays ``None``.

    Padding rows are zeros (``False`` for booleans, so a row mask drops them from reductions).
    """
    out = []
    for x in xs:
        if x is None:
            out.append(None)
            continue
        s = x.shape[0]
        n = -(-s // block_q)
        pad = n * block_q - s
        if pad:
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        out.append(x.reshape((n, block_q) + x.shape[1:]))
    return tuple(out)


def unblock(x, s):
    return x.reshape((-1,) + x.shape[2:])[:s]


def check_int(name, arg, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {arg} must be a Python int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: {arg} must be >= 1, got {value}")
    return int(value)



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
        score = sparse_scores(iqb, ik[safe], iwb, acc)
        logits = einsum("qhd,qkd->qhk", qb, kv[safe], acc) * jnp.asarray(scale, acc)
    return support & okb[:, None], score, logits


def check_indexer(name, q, k, weights, names=("q", "k", "weights")):
    nq, nk, nw = names
    if q.ndim < 3:
        raise ValueError(
            f"{name}: {nq} must be [..., S_q, index_n_heads, index_head_dim], got shape {q.shape}"
        )
    batch = q.shape[:-3]
    s_q, h_i, d_i = q.shape[-3:]
    if k.ndim != len(batch) + 2 or k.shape[:-2] != batch or k.shape[-1] != d_i:
        raise ValueError(
            f"{name}: {nk} must be [..., S_kv, index_head_dim] = {batch} + (S_kv, {d_i}) to match "
            f"{nq} {q.shape}, got shape {k.shape} ({nq} and {nk} need the same leading batch dims)"
        )
    s_kv = k.shape[-2]
    if s_kv < 1:
        raise ValueError(f"{name}: {nk} must have at least one key row (S_kv >= 1)")
    if weights.shape != batch + (s_q, h_i):
        raise ValueError(
            f"{name}: {nw} must be [..., S_q, index_n_heads] = {batch + (s_q, h_i)}, got shape "
            f"{weights.shape}"
        )
    for arg, x in zip(names, (q, k, weights)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: {arg} must be a float array, got {x.dtype}")
    return batch, s_q, h_i, s_kv


def check_positions(name, q_pos, kv_pos, q_seg, kv_seg, q_shape, kv_shape):
    """Validates positions and segment ids; ``q_shape``/``kv_shape`` None = only consistent."""
    if q_pos is None or kv_pos is None:
        raise TypeError(f"{name}: q_positions and kv_positions are required")
    q_pos, kv_pos = jnp.asarray(q_pos), jnp.asarray(kv_pos)
    if (q_seg is None) != (kv_seg is None):
        raise ValueError(f"{name}: give both q_segment_ids and kv_segment_ids, or neither")
    if q_seg is not None:
        q_seg, kv_seg = jnp.asarray(q_seg), jnp.asarray(kv_seg)
    if q_shape is None:
        if q_pos.ndim < 1:
            raise ValueError(f"{name}: q_positions must be [..., S_q], got shape {q_pos.shape}")
        if kv_pos.ndim != q_pos.ndim or kv_pos.shape[:-1] != q_pos.shape[:-1]:
            raise ValueError(
                f"{name}: kv_positions must be [..., S_kv] with q_positions' batch dims "
                f"{q_pos.shape[:-1]}, got shape {kv_pos.shape}"
            )
        q_shape, kv_shape = q_pos.shape, kv_pos.shape
    for arg, x, shape in (
        ("q_positions", q_pos, q_shape),
        ("kv_positions", kv_pos, kv_shape),
        ("q_segment_ids", q_seg, q_shape),
        ("kv_segment_ids", kv_seg, kv_shape),
    ):
        if x is None:
            continue
        if x.shape != shape:
            raise ValueError(f"{name}: {arg} must have shape {shape}, got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}: {arg} must be an integer array, got {x.dtype}")
    return q_pos, kv_pos, q_seg, kv_seg


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
        indices = jnp.asarray(indices)
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
