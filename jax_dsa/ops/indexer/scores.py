"""Index scores of the lightning indexer (DeepSeek-V3.2 paper, eq. 1;
deepseek-ai/DeepSeek-V3.2-Exp ``inference/model.py``)::

    I[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])

computed in float32 (float64 for float64 inputs). The positive scale factors of the reference
implementations (``index_n_heads**-0.5 * index_head_dim**-0.5``) belong to the caller, inside
``weights``. Also the indexer's fp8 quantisation and its argument checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.blocks import einsum


def relu(x):
    """``jax.nn.relu`` that keeps a NaN on every backend (XLA:CPU's fused ``maximum``, jax 0.11,
    returns 0 for it) and makes ``-inf`` NaN: a dot is ``-inf`` only when an operand holds an
    inf, which relu's 0 would hide from the loss. (The dense scores contract finite rows and put
    the NaN back per score, so they need neither.)"""
    return jnp.where(jnp.isnan(x) | (x == -jnp.inf), jnp.nan, jax.nn.relu(x))


def _finite_rows(x):
    ok = jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(ok[..., None], x, 0), ok


def dense_scores(qb, k, wb, acc):
    """``[B, H_I, D]``, ``[S_kv, D]``, ``[B, H_I]`` -> ``[B, S_kv]`` index scores; NaN where the
    query (its ``q`` or ``weights``) or the key holds a NaN or inf.

    The contractions run on finite operands (a non-finite row zeroed) and the NaN is put back
    per score: a masked score's zero gradient times a NaN key would otherwise reach every
    query's gradient, including queries that cannot see that key."""
    qb, q_ok = _finite_rows(qb)
    k, k_ok = _finite_rows(k)
    w_ok = jnp.isfinite(wb)
    dots = einsum("qhd,sd->qhs", qb, k, acc)
    score = jnp.sum(jax.nn.relu(dots) * jnp.where(w_ok, wb, 0).astype(acc)[:, :, None], axis=1)
    ok = jnp.all(q_ok & w_ok, axis=-1)[:, None] & k_ok[None, :]
    return jnp.where(ok, score, jnp.nan)


def sparse_scores(qb, rows, wb, acc, support):
    """``[B, H_I, D]``, gathered ``[B, K, D]``, ``[B, H_I]`` -> ``[B, K]`` index scores; 0 outside
    ``support [B, K]``, whose gradients are dropped (a NaN query times a zero-filled row must not
    reach the weights' gradient of an empty row)."""
    dots = jnp.where(support[:, None, :], einsum("qhd,qkd->qhk", qb, rows, acc), 0)
    return jnp.sum(relu(dots) * wb.astype(acc)[:, :, None], axis=1)


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
