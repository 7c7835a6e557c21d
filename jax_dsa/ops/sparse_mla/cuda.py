"""The ``"cuda"`` implementation of ``sparse_mla``: jax_dsa's own SM90 forward (FlashMLA v2's
sparse-prefill contract) and two SM90 backwards, the cuDNN frontend's DSA backward and jax_dsa's
own (``ffi/cuda/sparse_mla_bwd``), all compiled ahead of time into the ``_cuda`` FFI module.

Which backward runs: ``deterministic=True`` always takes jax_dsa's (the only deterministic one);
otherwise the environment variable ``JAX_DSA_SPARSE_MLA_BWD`` (read when the op is traced):
``"auto"`` (the default: cuDNN's below ``OWN_BWD_MIN_S_KV`` keys a batch element, jax_dsa's from
there on, where it is the faster: ``benchmarks/notes/sparse_mla_bwd.md``), ``"cudnn"`` or
``"jax_dsa"``. The backward's glue sorts each query's valid slots by kv row, which keeps the
reductions of concurrently running queries in one narrow row window.

Shapes follow :func:`jax_dsa.sparse_mla` after it folds the batch dims into one:
``q [B, S_q, H, D_qk]``, ``kv [B, S_kv, D_qk]``, ``indices [B, S_q, K]`` int32,
``attn_sink [H]`` float32, ``topk_length [B, S_q]`` int32.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import kernel_spec
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error
from jax_dsa.ops.sparse_mla.config import Call, Config


CUDA_BWD_TARGET = "jax_dsa_dsa_bwd_cuda"
OWN_BWD_TARGET = "jax_dsa_sparse_mla_bwd_cuda"  # jax_dsa's own backward
BWD_KERNEL_ENV = "JAX_DSA_SPARSE_MLA_BWD"
BWD_KERNELS = ("auto", "cudnn", "jax_dsa")
# "auto" takes jax_dsa's backward from this many keys a batch element. GLM-5 dims, the indexer's
# causal top-2048, one H100, same process: cuDNN 29.4 ms / ours 31.0 at 16K, 47.5 / 48.3 at 24K,
# 76.0 / 64.9 at 32K, 216.6 / 140.8 at 64K (benchmarks/results/deterministic_h100.json).
OWN_BWD_MIN_S_KV = 32768
COMPACT_TARGET = "jax_dsa_compact_slots_cuda"  # the backward glue's partition (or row sort)
MAX_SORTED_SLOTS = 8192  # kMaxSortSlots of ffi/cuda/slot_compact/launch.h
# What the kernels are compiled for (one source, read by the build too). Indices are padded with
# -1 to the smallest slot bucket >= K (past the last, the wide variant takes K as it is);
# topk_length makes the kernel stop at each row's valid count.
SLOT_BUCKETS = kernel_spec.DSA_BWD_SLOT_BUCKETS
KERNEL_HEADS = kernel_spec.SPARSE_MLA_HEADS
KERNEL_D_QK = kernel_spec.SPARSE_MLA_D_QK
KERNEL_D_V = kernel_spec.SPARSE_MLA_D_V
# The handlers' 32-bit extents (K * S_q is checked at run time by the handlers).
MAX_SLOTS = 2**30


def slot_bucket(k: int) -> int:
    """The backward's slot width for ``K`` slots per query: the smallest bucket >= K, else K
    itself rounded up to the forward's multiple (the wide variant)."""
    for b in SLOT_BUCKETS:
        if k <= b:
            return b
    m = kernel_spec.SPARSE_MLA_FWD_K_MULTIPLE
    return -(-k // m) * m


def cuda_support_error(dtype, h: int, d_qk: int, d_v: int, k: int) -> str | None:
    """Why the cuda backward cannot take this call, or None."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"implementation='cuda' needs bfloat16 q and kv, got {jnp.dtype(dtype)}"
    if d_qk not in KERNEL_D_QK or d_v != KERNEL_D_V:
        return (f"implementation='cuda' supports D_qk in {KERNEL_D_QK} with d_v={KERNEL_D_V}, got "
                f"D_qk={d_qk}, d_v={d_v}")
    if h > KERNEL_HEADS[-1]:
        return f"implementation='cuda' supports at most {KERNEL_HEADS[-1]} heads, got H={h}"
    if k > MAX_SLOTS:
        return f"implementation='cuda' supports at most {MAX_SLOTS} slots (K), got {k}"
    return None


CUDA_FWD_TARGET = "jax_dsa_sparse_mla_fwd_cuda"


def _cuda_dims(q, kv, indices, d_v):
    """``(B, S_q, H, D_qk, S_kv, K, padded H)`` of a call the CUDA kernels support (else
    ValueError naming the rule); H is padded to 64 or 128."""
    nb, s_q, h, d_qk = q.shape
    k = indices.shape[-1]
    why = cuda_support_error(q.dtype, h, d_qk, d_v, k)
    if why:
        raise ValueError("sparse_mla: " + why)
    hp = next(n for n in KERNEL_HEADS if h <= n)
    return nb, s_q, h, d_qk, kv.shape[1], k, hp


def forward_slots(indices, s_kv):
    """``[B, S_q, K]`` per-batch indices -> global row ids ``[B, S_q, K4]`` int32 (valid slots
    offset by ``b * S_kv``, invalid ones -1 so the offset cannot make them valid), padded with -1
    to K4, the forward kernel's multiple (it fetches each row of ids in 16-byte blocks)."""
    nb, _, k = indices.shape
    valid = (indices >= 0) & (indices < s_kv)
    offset = (jnp.arange(nb, dtype=jnp.int32) * s_kv)[:, None, None]
    idx = jnp.where(valid, indices + offset, -1).astype(jnp.int32)
    m = kernel_spec.SPARSE_MLA_FWD_K_MULTIPLE
    k4 = -(-k // m) * m
    if k4 > k:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, k4 - k)), constant_values=-1)
    return idx


def pad_heads(q, per_head, fill):
    """``q [B, S, H, D]`` bf16 and a per-head array (last axis H) padded to the kernels' head
    count (64 or 128): zero q, ``fill`` for the per-head values. Returns (q, per_head, padded H)."""
    h = q.shape[2]
    hp = next(n for n in KERNEL_HEADS if h <= n)
    q = q.astype(jnp.bfloat16)
    per_head = per_head.astype(jnp.float32)
    if hp > h:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
        pad = [(0, 0)] * (per_head.ndim - 1) + [(0, hp - h)]
        per_head = jnp.pad(per_head, pad, constant_values=fill)
    return q, per_head, hp


def cuda_forward(q, kv, indices, attn_sink, topk_length, *, sm_scale, d_v):
    """GPU forward through jax_dsa's own AOT SM90 kernel (FlashMLA v2 contract, ffi/cuda/
    sparse_mla_fwd_sm90.py): ``out [B, S_q, H, d_v]`` bfloat16, ``lse [B, S_q, H]`` float32
    (natural log, sink-free, +inf for rows without a valid slot) and ``max_logits [B, S_q, H]``
    float32 (-inf for such rows).

    Glue: batch folded into tokens (valid slots offset by ``b * S_kv``, invalid ones set to -1 so
    the offset cannot make them valid); slots padded with -1 to a multiple of 4 (the kernel
    prefetches each query's row of slot ids in 16-byte blocks); heads padded to 64 or
    128 (zero q, sink -inf), then sliced. Slots past ``topk_length`` are skipped by the kernel.
    """
    nb, s_q, h, d_qk, s_kv, k, _ = _cuda_dims(q, kv, indices, d_v)
    bf = jnp.bfloat16
    idx = forward_slots(indices, s_kv)
    k4 = idx.shape[-1]
    q, sink, hp = pad_heads(q, attn_sink, -jnp.inf)
    t = nb * s_q
    call = jax.ffi.ffi_call(
        CUDA_FWD_TARGET,
        (
            jax.ShapeDtypeStruct((t, hp, d_v), bf),
            jax.ShapeDtypeStruct((t, hp), jnp.float32),
            jax.ShapeDtypeStruct((t, hp), jnp.float32),
        ),
        vmap_method="sequential",
    )
    out, lse, mx = call(q.reshape(t, hp, d_qk), kv.astype(bf).reshape(nb * s_kv, d_qk),
                        idx.reshape(t, k4), topk_length.astype(jnp.int32).reshape(t), sink,
                        sm_scale=np.float32(sm_scale))
    out = out.reshape(nb, s_q, hp, d_v)[:, :, :h]
    lse = poisoned_lse(out, lse.reshape(nb, s_q, hp)[:, :, :h])
    return out, lse, mx.reshape(nb, s_q, hp)[:, :, :h]


def poisoned_lse(out, lse):
    """The kernel takes a row whose softmax sum is not > 0 for one without a valid slot (lse
    +inf); a NaN sum (the row read a NaN) leaves NaN in its out: make its lse NaN too, the ops'
    convention for poisoned rows. Reads one column of ``out``."""
    return jnp.where((lse == jnp.inf) & jnp.isnan(out[..., 0]), jnp.nan, lse)


CUDA_TARGET_TARGET = "jax_dsa_sparse_mla_target_cuda"


def cuda_target(q, kv, indices, lse, *, sm_scale, topk_length=None):
    """The indexer loss's target from the forward kernel's target mode: ``mass [B, S_q, K]``
    float32 with ``mass[b, t, j] = sum_h exp(sm_scale * q[b, t, h] . kv[b, idx] - lse[b, t, h])``
    for valid slots (``0 <= idx < S_kv``; 0 for the others), from ``q [B, S_q, H, D_qk]``,
    ``kv [B, S_kv, D_qk]``, ``indices [B, S_q, K]`` and ``lse [B, S_q, H]`` (natural log; +inf
    for a head without slots). One pass of Q K^T on the tensor cores, no P V. ``topk_length
    [B, S_q]`` (optional): slots past it are skipped (their mass is not written: 0 here only
    where the caller masks it).

    Glue as :func:`cuda_forward` (batch folded, slots padded to a multiple of 4, heads padded
    with zero q and lse +inf); the kernel's per-64-head-group sums are added here."""
    nb, s_q, h, d_qk = q.shape
    s_kv, k = kv.shape[1], indices.shape[-1]
    bf = jnp.bfloat16
    idx = forward_slots(indices, s_kv)
    k4 = idx.shape[-1]
    q, lse, hp = pad_heads(q, lse, jnp.inf)
    t, groups = nb * s_q, hp // 64
    call = jax.ffi.ffi_call(CUDA_TARGET_TARGET,
                            jax.ShapeDtypeStruct((t * groups, k4), jnp.float32),
                            vmap_method="sequential")
    mass = call(q.reshape(t, hp, d_qk), kv.astype(bf).reshape(nb * s_kv, d_qk),
                idx.reshape(t, k4),
                (jnp.full((t,), k4, jnp.int32) if topk_length is None
                 else topk_length.astype(jnp.int32).reshape(t)),
                lse.reshape(t, hp),
                sm_scale=np.float32(sm_scale))
    return jnp.sum(mass.reshape(nb, s_q, groups, k4), axis=2)[..., :k]


def cuda_workspace_bytes(s_q: int, s_kv: int, h: int, d_qk: int) -> int:
    """The SM90 backward's scratch (frontend 1.32 ``flash_attn_bwd_sm90_workspace_size``)."""
    r = lambda x, m: -(-x // m) * m
    return 2 * r(r(s_q, 64) * h * 4, 128) + r(r(s_kv, 64) * r(d_qk, 32) * 4, 128)


def own_backward_workspace_bytes(s_q: int, s_kv: int, h: int, d_qk: int, k: int,
                                 deterministic: bool) -> int:
    """The own backward's scratch (``SparseMlaBwdWorkspaceBytes`` of
    ``ffi/cuda/sparse_mla_bwd/launch.h``, which the handler checks): per-row statistics, the
    fp32 dKV accumulator and, when deterministic, one chunk's bf16 partial rows (at most 2 GiB; a
    chunk short of all ``s_q`` queries and over 132 is a multiple of 132), sort keys and
    values, the CSR offsets and CUB's scratch."""
    up = lambda x: -(-x // 256) * 256
    total = 3 * up(s_q * h * 4) + up(s_kv * d_qk * 4)
    if deterministic:
        chunk = min((1 << 31) // (k * d_qk * 2), (2**31 - 1) // k)
        chunk = s_q if chunk >= s_q else max(1, chunk // 132 * 132 if chunk > 132 else chunk)
        n = chunk * k
        total += (up(n * d_qk * 2) + 4 * up(n * 4) + 2 * up((s_kv + 1) * 4)
                  + up((1 << 20) + 4 * n + 4 * (s_kv + 1)))
    return total


def backward_kernel(deterministic: bool, s_kv: int | None = None) -> str:
    """``"cudnn"`` or ``"jax_dsa"``: the backward a call runs (module docstring); ``s_kv``: keys a
    batch element (None: "auto" takes cuDNN's).

    Raises:
      ValueError: ``JAX_DSA_SPARSE_MLA_BWD`` is not one of ``BWD_KERNELS``, or is ``"cudnn"``
        while ``deterministic`` (cuDNN's backward sums dKV with atomics).
    """
    choice = os.environ.get(BWD_KERNEL_ENV, "auto") or "auto"
    if choice not in BWD_KERNELS:
        raise ValueError(f"{BWD_KERNEL_ENV}={choice!r}: expected one of {BWD_KERNELS}")
    if deterministic:
        if choice == "cudnn":
            raise ValueError(f"{BWD_KERNEL_ENV}=cudnn with deterministic=True: cuDNN's backward "
                             "is not deterministic; unset it or use 'jax_dsa'")
        return "jax_dsa"
    if choice == "auto":
        return "jax_dsa" if s_kv is not None and s_kv >= OWN_BWD_MIN_S_KV else "cudnn"
    return choice


def cuda_slot_rows(indices, topk_length, s_kv):
    """``[B, S_q, K]`` indices -> (global rows of the valid slots in place, -1 elsewhere; per-row
    valid count >= 1; rows that had no valid slot). An empty row gets one slot, row 0 of its
    batch element, which the caller masks with lse = +inf and dout = 0. Pure JAX, elementwise:
    :func:`compact_slots` then moves each row's valid slots to the front."""
    nb, _, k = indices.shape
    pos = jnp.arange(k, dtype=jnp.int32)
    valid = (indices >= 0) & (indices < s_kv) & (pos < topk_length[..., None])
    count = jnp.sum(valid, axis=-1, dtype=jnp.int32)
    empty = count == 0
    offset = (jnp.arange(nb, dtype=jnp.int32) * s_kv)[:, None, None]
    rows = jnp.where(valid, indices + offset, -1)
    rows = jnp.where(empty[..., None] & (pos == 0), offset, rows)
    return rows, jnp.maximum(count, 1), empty


def compact_slots(rows, k_out: int, n_rows: int | None = None):
    """``rows [T, K]`` int32 -> ``[T, k_out]`` (``k_out >= K``): each row's entries >= 0 moved to
    its front, -1 after; in their order, or ascending when ``n_rows`` (every entry is below it)
    is given and ``K <= MAX_SORTED_SLOTS``. One kernel of the ``_cuda`` module (a block scan or a
    block radix sort a row), without the host round trip or the sort an XLA partition would
    need."""
    t, k = rows.shape
    if k_out < k:
        raise ValueError(f"compact_slots: k_out={k_out} must be >= K={k}")
    key_bits = 0 if n_rows is None or k > MAX_SORTED_SLOTS else max(1, int(n_rows).bit_length())
    return jax.ffi.ffi_call(COMPACT_TARGET, jax.ShapeDtypeStruct((t, k_out), jnp.int32),
                            vmap_method="sequential")(rows, key_bits=np.int32(key_bits))


def cuda_index_glue(indices, topk_length, s_kv, k_out=None, sort_rows=False):
    """``[B, S_q, K]`` indices -> (``[B, S_q, k_out]`` global rows with the valid slots first and
    -1 after, per-row count >= 1, rows that had no valid slot): :func:`cuda_slot_rows`, then
    :func:`compact_slots` (``k_out`` defaults to ``K``; ``sort_rows``: the valid slots in
    ascending row, up to ``MAX_SORTED_SLOTS`` slots, else in their order)."""
    nb, s_q, k = indices.shape
    k_out = k if k_out is None else k_out
    rows, length, empty = cuda_slot_rows(indices, topk_length, s_kv)
    idx = compact_slots(rows.reshape(nb * s_q, k), k_out,
                        n_rows=nb * s_kv if sort_rows else None).reshape(nb, s_q, k_out)
    return idx, length, empty


def cuda_backward(q, kv, indices, attn_sink, topk_length, out, lse, dout, *, sm_scale, d_v,
                  deterministic=False):
    """GPU backward through the AOT kernels (:func:`backward_kernel` picks cuDNN's or jax_dsa's):
    ``dq``, ``dkv``, ``d_attn_sink [H]`` float32.

    Glue around the kernel's contract: batch folded into tokens (indices offset by
    ``b * S_kv``); slots out of range or past ``topk_length`` set to -1 and the valid ones moved
    to the front in ascending row (past ``MAX_SORTED_SLOTS`` slots: in their order), so
    ``topk_length`` = valid count; slots padded with -1 to a bucket;
    heads padded to 64 or 128 (zero q/out/dout, lse +inf, sink -inf); rows without a valid slot
    get one slot (row 0 of their batch element) with dout 0 and lse +inf, because the kernel needs
    at least one (as NVIDIA/Megatron-LM's DSA does); then everything un-padded.
    """
    nb, s_q, h, d_qk, s_kv, k, hp = _cuda_dims(q, kv, indices, d_v)
    kb = slot_bucket(k)

    idx, length, empty = cuda_index_glue(indices, topk_length, s_kv, kb, sort_rows=True)

    bf = jnp.bfloat16
    dout = jnp.where(empty[..., None, None], 0, dout.astype(bf))
    lse = jnp.where(empty[..., None], jnp.inf, lse.astype(jnp.float32))
    q, out = q.astype(bf), out.astype(bf)
    sink = attn_sink.astype(jnp.float32)
    if hp > h:
        ph = ((0, 0), (0, 0), (0, hp - h), (0, 0))
        q, out, dout = jnp.pad(q, ph), jnp.pad(out, ph), jnp.pad(dout, ph)
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, hp - h)), constant_values=jnp.inf)
        sink = jnp.pad(sink, (0, hp - h), constant_values=-jnp.inf)

    t = nb * s_q
    dq, dkv, dsink = cuda_backward_rows(
        q.reshape(t, hp, d_qk), kv.astype(bf).reshape(nb * s_kv, d_qk), out.reshape(t, hp, d_v),
        dout.reshape(t, hp, d_v), lse.reshape(t, hp), sink, idx.reshape(t, kb),
        length.reshape(t), sm_scale=sm_scale, deterministic=deterministic, s_kv=s_kv)
    dq = dq.reshape(nb, s_q, hp, d_qk)[:, :, :h]
    return dq, dkv.reshape(nb, s_kv, d_qk), dsink[:h]


def cuda_backward_rows(q, kv, out, dout, lse, sink, rows, length, *, sm_scale,
                       deterministic=False, s_kv=None):
    """The backward kernel's call on folded, padded operands: ``q [T, Hp, D_qk]``, ``kv [R,
    D_qk]``, ``out`` / ``dout [T, Hp, d_v]`` bfloat16, ``lse [T, Hp]`` and ``sink [Hp]`` float32,
    ``rows [T, Kb]`` int32 (kv rows, the valid ones first and -1 after; ``Kb`` a slot bucket)
    and ``length [T]`` (each row's valid count, >= 1). Returns ``(dq [T, Hp, D_qk] bf16, dkv [R,
    D_qk] bf16, d_sink [Hp] float32)``. ``deterministic``: jax_dsa's own kernel, which sums
    dkv in a fixed order (bitwise reproducible); else :func:`backward_kernel`'s choice for
    ``s_kv`` keys a batch element (both sum dkv with fp32 atomics)."""
    t, hp, d_qk = q.shape
    if backward_kernel(deterministic, s_kv) == "jax_dsa":
        ws = own_backward_workspace_bytes(t, kv.shape[0], hp, d_qk, rows.shape[1], deterministic)
        target, attrs = OWN_BWD_TARGET, {"deterministic": bool(deterministic)}
    else:
        ws = cuda_workspace_bytes(t, kv.shape[0], hp, d_qk)
        target, attrs = CUDA_BWD_TARGET, {}
    bf = jnp.bfloat16
    call = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct((t, hp, d_qk), bf),
            jax.ShapeDtypeStruct(kv.shape, bf),
            jax.ShapeDtypeStruct((hp,), jnp.float32),
            jax.ShapeDtypeStruct((ws,), jnp.uint8),
        ),
        vmap_method="sequential",
    )
    dq, dkv, dsink, _ = call(q, kv, out, dout, lse, sink, rows, length,
                             sm_scale=np.float32(sm_scale), **attrs)
    return dq, dkv, dsink


def supported(call: Call) -> str | None:
    """Why ``"cuda"`` cannot take ``call``: the head width first (a property of the compiled
    kernels, told even where they are not built), then the build, then the other rules."""
    if call.d_qk not in KERNEL_D_QK:
        return f"implementation='cuda' supports D_qk in {KERNEL_D_QK}, got {call.d_qk}"
    return (native_unavailable("cuda", "_cuda")
            or cuda_support_error(call.dtype, call.h, call.d_qk, call.d_v, call.topk)
            or sm90_device_error())


def _forward(q, kv, indices, sink, lengths, config: Config):
    return cuda_forward(q, kv, indices, sink, lengths, sm_scale=config.sm_scale, d_v=config.d_v)


def _backward(q, kv, indices, sink, lengths, out, lse, dout, config: Config):
    dq, dkv, dsink = cuda_backward(q, kv, indices, sink, lengths, out, lse, dout,
                                   sm_scale=config.sm_scale, d_v=config.d_v,
                                   deterministic=config.deterministic)
    return dq.astype(q.dtype), dkv.astype(kv.dtype), dsink.astype(sink.dtype)


IMPLEMENTATION = Implementation("cuda", supported, _forward, _backward, platforms=("gpu",))
