"""The argument checks that the attention ops (``sparse_mla``, ``dense_mla``) share; the
``sm_scale`` rule also serves the indexer KL losses."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp


def check_sm_scale(name, sm_scale, what="the model's softmax scale, e.g. 1/16 for GLM-5"):
    """``sm_scale`` must be a finite Python number > 0 (``what`` says whose scale it is).

    Raises:
      TypeError: not a number (or a bool). ValueError: not finite, or <= 0.
    """
    if sm_scale is None or not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool):
        raise TypeError(f"{name}: sm_scale must be a Python number ({what}); got {sm_scale!r}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"{name}: sm_scale must be finite and > 0, got {sm_scale!r}")


def check_attention_args(name, q, kv, sm_scale, d_v, attn_sink):
    """Checks ``sm_scale``, ``q [..., S_q, H, D_qk]``, ``kv [..., S_kv, D_qk]`` (q's batch dims
    and float dtype), ``d_v`` and the optional ``attn_sink [H]``; returns q's batch dims.

    Raises:
      TypeError: ``sm_scale`` not a number, non-float or mismatched ``q``/``kv``, a non-float
        ``attn_sink``.
      ValueError: ``sm_scale`` not finite and positive, wrong ranks or shapes, ``d_v`` out of
        range. Messages start with ``name`` and name the argument.
    """
    check_sm_scale(name, sm_scale)
    if q.ndim < 3:
        raise ValueError(f"{name}: q must be [..., S_q, H, D_qk], got shape {q.shape}")
    batch = q.shape[:-3]
    if kv.ndim != len(batch) + 2 or kv.shape[:-2] != batch:
        raise ValueError(
            f"{name}: kv must be [..., S_kv, D_qk] with q's batch dims {batch}, got shape "
            f"{kv.shape} for q {q.shape}"
        )
    h, d_qk = q.shape[-2:]
    if h < 1 or d_qk < 1:
        raise ValueError(f"{name}: q needs H >= 1 heads and D_qk >= 1, got shape {q.shape}")
    if kv.shape[-1] != d_qk:
        raise ValueError(f"{name}: kv's last dim {kv.shape[-1]} must equal q's D_qk {d_qk}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype != kv.dtype:
        raise TypeError(
            f"{name}: q and kv must share one float dtype, got {q.dtype} and {kv.dtype}"
        )
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral) or not 0 < d_v <= d_qk:
        raise ValueError(f"{name}: d_v must be an int with 0 < d_v <= D_qk={d_qk}, got {d_v!r}")
    if attn_sink is not None:
        if attn_sink.shape != (h,):
            raise ValueError(f"{name}: attn_sink must be [H]=({h},), got {attn_sink.shape}")
        if not jnp.issubdtype(attn_sink.dtype, jnp.floating):
            raise TypeError(f"{name}: attn_sink must be a float array, got {attn_sink.dtype}")
    return batch
