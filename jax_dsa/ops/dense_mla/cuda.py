"""The ``"cuda"`` forward of ``dense_mla``: the SM90 sparse-MLA forward kernel in its contiguous
mode (``ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py``, FFI target
``jax_dsa_dense_mla_fwd_cuda``).

Each query's visible keys (``kv_pos <= q_pos``, same segment) are made one contiguous run of kv
rows: the glue sorts each batch element's keys by (segment id, position) (stable), so the keys
visible to query ``t`` are exactly the sorted rows ``[lo_t, hi_t)`` with ``lo_t`` the first key of
``t``'s segment and ``hi_t`` past the last key of that segment with position ``<= q_pos[t]``
(found by a vectorised binary search, ``log2(S_kv)`` gathers). The kernel then reads rows
``lo_t + j`` for ``j < hi_t - lo_t``: no slot list, no ``[S_q, S_kv]`` array, work proportional to
the visible pairs. For the usual packing (segments in runs, positions rising) the sort is the
identity.

The backward is the cuDNN frontend's SM90 DSA backward (the one behind ``sparse_mla``'s
``"cuda"`` backward) over chunks of ``BWD_CHUNK`` key columns (``lax.scan``): chunk ``c`` of every
query's run serves as its slot list (valid slots first, the row's count as ``topk_length``).
With the full row's ``lse`` (the sink folded in) and the kernel's ``rowsum(dout * out)``, each
chunk's ``dq`` and ``dkv`` are exact partial sums, added in float32; rows with no key in a chunk
get ``lse = +inf`` (zero probabilities). The sink's gradient, which depends on no key, is formed
once here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import kernel_spec
from jax_dsa.ops.dense_mla.config import Call, Config
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error
from jax_dsa.ops.sparse_mla.cuda import poisoned_lse, cuda_backward_rows, pad_heads, slot_bucket

DENSE_FWD_TARGET = "jax_dsa_dense_mla_fwd_cuda"


def _upper_bound(sorted_seg, sorted_pos, seg, pos):
    """Per query, the number of sorted keys ``(s, p) <= (seg, pos)`` lexicographically, with
    ``s == seg`` required for ``p`` to count (i.e. ``(s < seg) or (s == seg and p <= pos)``).

    sorted_*: ``[S_kv]`` ascending by (seg, pos); seg, pos: ``[S_q]``. Returns ``[S_q]`` int32."""
    n = sorted_seg.shape[0]
    lo = jnp.zeros(seg.shape, jnp.int32)
    hi = jnp.full(seg.shape, n, jnp.int32)
    for _ in range(max(1, int(n).bit_length())):
        mid = (lo + hi) // 2
        m = jnp.minimum(mid, n - 1)
        s, p = sorted_seg[m], sorted_pos[m]
        le = (mid < hi) & ((s < seg) | ((s == seg) & (p <= pos)))
        lo = jnp.where(le, mid + 1, lo)
        hi = jnp.where(le, hi, mid)
    return lo


def _lower_bound_seg(sorted_seg, seg):
    """Per query, the number of sorted keys with segment ``< seg``."""
    return jnp.searchsorted(sorted_seg, seg, side="left").astype(jnp.int32)


def dense_runs(q_pos, kv_pos, q_seg=None, kv_seg=None):
    """``(perm [B, S_kv], lo [B, S_q], count [B, S_q])`` int32: the key order that makes every
    query's visible keys the run ``perm[lo : lo + count]``."""
    nb, s_kv = kv_pos.shape
    kv_pos = kv_pos.astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)
    if q_seg is None:
        kv_seg = jnp.zeros_like(kv_pos)
        q_seg = jnp.zeros_like(q_pos)
    kv_seg, q_seg = kv_seg.astype(jnp.int32), q_seg.astype(jnp.int32)
    iota = jnp.broadcast_to(jnp.arange(s_kv, dtype=jnp.int32), (nb, s_kv))
    s_seg, s_pos, perm = jax.lax.sort((kv_seg, kv_pos, iota), dimension=1, num_keys=2,
                                      is_stable=True)
    hi = jax.vmap(_upper_bound)(s_seg, s_pos, q_seg, q_pos)
    lo = jax.vmap(_lower_bound_seg)(s_seg, q_seg)
    return perm, lo, jnp.maximum(hi - lo, 0)


def _runs_operands(kv, q_pos, kv_pos, q_seg, kv_seg):
    """The kernel's key operands: sorted kv rows ``[B * S_kv, D]`` bf16, each query's run start
    (global row, column 0 of ``[B * S_q, 4]``), its length ``[B, S_q]`` and the permutation."""
    nb, s_kv, d_qk = kv.shape
    perm, lo, count = dense_runs(q_pos, kv_pos, q_seg, kv_seg)
    kv_sorted = jnp.take_along_axis(kv.astype(jnp.bfloat16), perm[..., None], axis=1)
    first = lo + (jnp.arange(nb, dtype=jnp.int32) * s_kv)[:, None]
    m = kernel_spec.SPARSE_MLA_FWD_K_MULTIPLE
    runs = jnp.pad(first[..., None], ((0, 0), (0, 0), (0, m - 1)))  # column 0: the run's start
    return kv_sorted.reshape(nb * s_kv, d_qk), runs.reshape(-1, m), count, perm


def cuda_dense_forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, attn_sink, *, sm_scale, d_v):
    """``out [B, S_q, H, d_v]`` bfloat16 and ``lse [B, S_q, H]`` float32 (natural log, sink-free,
    +inf for rows with no visible key), from ``q [B, S_q, H, D_qk]``, ``kv [B, S_kv, D_qk]``.

    Glue: keys sorted into runs (``dense_runs``), batch folded into tokens (run starts offset
    by ``b * S_kv``), heads padded to 64 or 128 (zero q, sink -inf), then sliced."""
    nb, s_q, h, d_qk = q.shape
    bf = jnp.bfloat16
    kv_rows, runs, count, _ = _runs_operands(kv, q_pos, kv_pos, q_seg, kv_seg)
    q, sink, hp = pad_heads(q, attn_sink, -jnp.inf)
    t = nb * s_q
    call = jax.ffi.ffi_call(
        DENSE_FWD_TARGET,
        (jax.ShapeDtypeStruct((t, hp, d_v), bf),
         jax.ShapeDtypeStruct((t, hp), jnp.float32),
         jax.ShapeDtypeStruct((t, hp), jnp.float32)),
        vmap_method="sequential",
    )
    out, lse, _ = call(q.reshape(t, hp, d_qk), kv_rows, runs, count.reshape(t), sink,
                       sm_scale=np.float32(sm_scale))
    out = out.reshape(nb, s_q, hp, d_v)[:, :, :h]
    return out, poisoned_lse(out, lse.reshape(nb, s_q, hp)[:, :, :h])


BWD_CHUNK = 8192  # key columns per backward kernel call (its wide variant past 2048)


def cuda_dense_backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, attn_sink, out, lse, dout, *,
                        sm_scale, deterministic=False):
    """``(dq [B, S_q, H, D_qk], dkv [B, S_kv, D_qk])`` float32 and ``d_attn_sink [H]`` float32
    of the dense forward, from its ``out`` and ``lse`` (natural log, sink-free, +inf for rows
    without keys) and ``dout [B, S_q, H, d_v]``; see the module docstring. ``deterministic``:
    the chunks' backward in its deterministic mode (the chunks add in scan order)."""
    nb, s_q, h, d_qk = q.shape
    s_kv, d_v = kv.shape[1], out.shape[-1]
    f32, bf = jnp.float32, jnp.bfloat16
    perm, lo, count = dense_runs(q_pos, kv_pos, q_seg, kv_seg)
    sink, lse = attn_sink.astype(f32), lse.astype(f32)
    has_key = lse != jnp.inf  # NaN (a poisoned row) is not empty
    lse_full = jnp.where(has_key, jnp.logaddexp(lse, sink), jnp.inf)
    delta = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1)  # rowsum(dout * out)
    # exp(sink - lse_full) as a sigmoid: finite (1) for a sink of +inf.
    d_sink = -jnp.sum(jnp.where(has_key, jax.nn.sigmoid(sink - lse), 0) * delta, axis=(0, 1))

    q, lse_full, hp = pad_heads(q, lse_full, jnp.inf)
    pad = ((0, 0), (0, 0), (0, hp - h), (0, 0))
    t = nb * s_q
    out = jnp.pad(out.astype(bf), pad).reshape(t, hp, d_v)
    dout = jnp.pad(dout.astype(bf), pad).reshape(t, hp, d_v)
    q = q.reshape(t, hp, d_qk)
    kv = kv.astype(bf).reshape(nb * s_kv, d_qk)
    no_sink = jnp.full((hp,), -jnp.inf, f32)
    width = min(BWD_CHUNK, s_kv)
    bucket = slot_bucket(width)
    cols = jnp.arange(bucket, dtype=jnp.int32)
    offset = (jnp.arange(nb, dtype=jnp.int32) * s_kv)[:, None, None]

    def body(carry, c):
        first = c * width
        n = jnp.clip(count - first, 0, width)
        at = jnp.minimum(lo[..., None] + first + cols, s_kv - 1)
        rows = jnp.where(cols < n[..., None], jax.vmap(lambda p, i: p[i])(perm, at) + offset, -1)
        # a row without keys here: one slot (row 0 of its batch element), zero probabilities
        rows = rows.at[..., 0].set(jnp.where(n > 0, rows[..., 0], offset[..., 0]))
        lse_c = jnp.where((n > 0)[..., None], lse_full, jnp.inf)
        dq, dkv, _ = cuda_backward_rows(q, kv, out, dout, lse_c.reshape(t, hp), no_sink,
                                        rows.reshape(t, bucket), jnp.maximum(n, 1).reshape(t),
                                        sm_scale=sm_scale, deterministic=deterministic)
        return (carry[0] + dq.astype(f32), carry[1] + dkv.astype(f32)), None

    init = (jnp.zeros((t, hp, d_qk), f32), jnp.zeros((nb * s_kv, d_qk), f32))
    (dq, dkv), _ = jax.lax.scan(body, init, jnp.arange(-(-s_kv // width), dtype=jnp.int32))
    return (dq.reshape(nb, s_q, hp, d_qk)[:, :, :h], dkv.reshape(nb, s_kv, d_qk), d_sink)


def supported(call: Call) -> str | None:
    """Why ``"cuda"`` cannot take ``call``: the kernels' widths and heads first (told even where
    they are not built), then the build, then the GPU."""
    if jnp.dtype(call.dtype) != jnp.bfloat16:
        return f"implementation='cuda' needs bfloat16 q and kv, got {jnp.dtype(call.dtype)}"
    if call.d_qk not in kernel_spec.SPARSE_MLA_D_QK or call.d_v != kernel_spec.SPARSE_MLA_D_V:
        return (f"implementation='cuda' supports D_qk in {kernel_spec.SPARSE_MLA_D_QK} with "
                f"d_v={kernel_spec.SPARSE_MLA_D_V}, got D_qk={call.d_qk}, d_v={call.d_v}")
    if call.h > kernel_spec.SPARSE_MLA_HEADS[-1]:
        return (f"implementation='cuda' supports at most {kernel_spec.SPARSE_MLA_HEADS[-1]} "
                f"heads, got H={call.h}")
    return native_unavailable("cuda", "_cuda") or sm90_device_error()


def _forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config: Config):
    out, lse = cuda_dense_forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink,
                                  sm_scale=config.sm_scale, d_v=config.d_v)
    return out.astype(q.dtype), lse


def _backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout, config: Config):
    dq, dkv, d_sink = cuda_dense_backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse,
                                          dout, sm_scale=config.sm_scale,
                                          deterministic=config.deterministic)
    return dq.astype(q.dtype), dkv.astype(kv.dtype), d_sink.astype(sink.dtype)


IMPLEMENTATION = Implementation("cuda", supported, _forward, _backward, platforms=("gpu",))
