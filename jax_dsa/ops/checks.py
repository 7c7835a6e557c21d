"""Argument checks shared by the ops: ``sm_scale``, the attention operands (``sparse_mla``,
``dense_mla``), positions and segment ids, static integer arguments."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

# Past this, float32 logits overflow for |q . k| of a few thousand; real models use <= 1.
MAX_SM_SCALE = 1e4
_I32 = np.iinfo(np.int32)


def check_sm_scale(name, sm_scale, what="the model's softmax scale, e.g. 1/16 for GLM-5"):
    """``sm_scale`` must be a finite Python number > 0 (``what`` says whose scale it is).

    Raises:
      TypeError: not a number (or a bool). ValueError: not finite, <= 0, or > MAX_SM_SCALE.
    """
    if sm_scale is None or not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool):
        raise TypeError(f"{name}: sm_scale must be a Python number ({what}); got {sm_scale!r}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"{name}: sm_scale must be finite and > 0, got {sm_scale!r}")
    if sm_scale > MAX_SM_SCALE:
        raise ValueError(
            f"{name}: sm_scale must be <= {MAX_SM_SCALE:g} (larger scales overflow the float32 "
            f"logits; real models use <= 1), got {sm_scale!r}")


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


def check_int(name, arg, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {arg} must be a Python int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name}: {arg} must be >= 1, got {value}")
    return int(value)


def check_positions(name, q_pos, kv_pos, q_seg, kv_seg, q_shape, kv_shape):
    """Validates positions and segment ids; ``q_shape``/``kv_shape`` None = only consistent."""
    if q_pos is None or kv_pos is None:
        raise TypeError(f"{name}: q_positions and kv_positions are required")
    q_pos = int32_positions(name, "q_positions", q_pos)
    kv_pos = int32_positions(name, "kv_positions", kv_pos)
    if (q_seg is None) != (kv_seg is None):
        raise ValueError(f"{name}: give both q_segment_ids and kv_segment_ids, or neither")
    if q_seg is not None:
        q_seg = int32_positions(name, "q_segment_ids", q_seg)
        kv_seg = int32_positions(name, "kv_segment_ids", kv_seg)
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


def _is_wide(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind in "iu" and (dtype.itemsize > 4 or dtype == np.uint32)


def int32_slots(x):
    """Slot indices or ``topk_length`` as an int32 array with their meaning kept.

    Values past int32's range are clamped to its ends, so an out-of-range index stays invalid
    (``< 0`` or ``>= S_kv``) and a length past ``K`` still means every slot; ``jnp.asarray`` of a
    NumPy int64 array would wrap them into range instead (with x64 off). Other dtypes pass
    unchanged, for the callers' type checks.
    """
    if isinstance(x, jax.Array):
        if not _is_wide(x.dtype):
            return x
        hi = jnp.asarray(_I32.max, x.dtype)
        y = jnp.minimum(x, hi) if jnp.issubdtype(x.dtype, jnp.unsignedinteger) else jnp.clip(
            x, jnp.asarray(_I32.min, x.dtype), hi)
        return y.astype(jnp.int32)
    a = np.asarray(x)
    if not _is_wide(a.dtype):
        return jnp.asarray(a)
    a = np.minimum(a, _I32.max) if a.dtype.kind == "u" else np.clip(a, _I32.min, _I32.max)
    return jnp.asarray(a.astype(np.int32))


def int32_positions(name, arg, x):
    """Positions or segment ids as an array, refusing host values outside int32 (clamping
    would change which keys a query sees).

    Raises:
      ValueError: a NumPy or Python integer value outside [-2**31, 2**31).
    """
    if x is None or isinstance(x, jax.Array):
        return x
    a = np.asarray(x)
    if _is_wide(a.dtype) and a.size and (a.max() > _I32.max or a.min() < _I32.min):
        raise ValueError(f"{name}: {arg} must fit int32, got values in [{a.min()}, {a.max()}]")
    return jnp.asarray(a)
