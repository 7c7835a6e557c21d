"""The ``"cuda"`` implementation of ``indexer_topk``: jax_dsa's own SM90 kernels (plain CUDA C++,
``ffi/cuda/indexer_topk``) in the ``_cuda_indexer`` FFI module.

The contract is the ``"xla"`` implementation's (:mod:`jax_dsa.ops.indexer.topk.xla`): descending
score, exact ties to the lower key index, ``-0.0 == +0.0``, visible scores never below the
lowest finite float, ``-1`` past the visible keys, bitwise deterministic. What differs is the
arithmetic of the scores: ``q`` and ``k`` are rounded to bfloat16 for the tensor cores (exact
for bfloat16 inputs, the layers' case, and for the fp8 values of ``qk_dtype="float8_e4m3fn"``
times their power-of-two scales), ``q . k`` is accumulated in float32 by the tensor cores
and ``relu(.) * weights`` summed over the heads in float32 in a fixed order of the kernel's own.
So for bfloat16 ``q``/``k`` the scores equal the ``"xla"`` ones up to float32 summation order
(relative ~1e-6), and the selections agree except between keys whose scores are that close;
float32 ``q``/``k`` are rounded to bfloat16 first (a larger difference, see the tests).

Shapes (flattened batches, as :func:`jax_dsa.ops.indexer.topk.xla.forward`): ``q [NB, S_q, H_I,
128]``, ``k [NB, S_kv, 128]``, ``weights [NB, S_q, H_I]``, positions and segment ids
``[NB, S_q]`` / ``[NB, S_kv]`` (segment ids may be ``None``). Index heads are padded to 32 or 64
with zero q and zero weight (a contribution of exactly 0). The scores of a chunk of query rows
(``[chunk_rows, S_kv]`` float32, at most :data:`WORKSPACE_LIMIT` bytes) live in the custom call's
workspace result; the handler loops over batch elements and chunks.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa.ops.indexer.topk.config import TopkCall, TopkConfig
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error

MODULE = "_cuda_indexer"
TARGET = "jax_dsa_indexer_topk_cuda"
LSE_TARGET = "jax_dsa_indexer_lse_cuda"  # the scores' log-sum-exp per row (no top-k)
KERNEL_HEAD_DIM = 128
KERNEL_HEADS = (32, 64)  # index heads are padded to one of these
MAX_TOPK = 2048
MAX_S_KV = 1 << 21
KEY_TILE = 64  # the score buffer's row stride is S_kv rounded up to this
ROW_TILE = 8  # a chunk's rows: a multiple of the score kernel's 8 rows per CTA
# Bytes of score buffer per chunk of query rows (the workspace result's main part).
WORKSPACE_LIMIT = 1 << 30


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_heads(h: int) -> int:
    """The compiled head count that ``h`` index heads are padded to."""
    for hp in KERNEL_HEADS:
        if h <= hp:
            return hp
    raise ValueError(f"indexer_topk: implementation='cuda' supports at most {KERNEL_HEADS[-1]} "
                     f"index heads, got {h}")


def chunk_rows(s_q: int, s_kv: int) -> int:
    """Query rows per chunk: as many as fit :data:`WORKSPACE_LIMIT` (a multiple of 8, >= 8),
    no more than ``S_q`` rounded up to 8."""
    ld = _round_up(s_kv, KEY_TILE)
    rows = max(ROW_TILE, (WORKSPACE_LIMIT // (ld * 4)) // ROW_TILE * ROW_TILE)
    return min(rows, _round_up(max(s_q, 1), ROW_TILE))


def workspace_bytes(s_kv: int, rows: int) -> int:
    """Bytes of the workspace result (ffi/cuda/indexer_topk/launch.h TopkWorkspaceBytes):
    scores ``[rows, ld]`` float32, row ranges ``[rows]`` int2, key-tile stats ``[ld / 64]``
    int4, each 256-byte aligned."""
    ld = _round_up(s_kv, KEY_TILE)
    return (_round_up(rows * ld * 4, 256) + _round_up(rows * 8, 256)
            + _round_up(ld // KEY_TILE * 16, 256))


def module_error():
    """Why the ``_cuda_indexer`` module is not available in this install (None when loaded)."""
    return native_unavailable("cuda", MODULE)


def shape_error(dtype, h: int, d: int, s_kv: int, topk: int) -> str | None:
    """Why the compiled kernels cannot take these sizes, or None."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
        return (f"implementation='cuda' takes float32/bfloat16/float16 inputs (q and k are "
                f"rounded to bfloat16), got {dtype}")
    if d != KERNEL_HEAD_DIM:
        return f"implementation='cuda' supports index_head_dim {KERNEL_HEAD_DIM}, got {d}"
    if h > KERNEL_HEADS[-1]:
        return (f"implementation='cuda' supports at most {KERNEL_HEADS[-1]} index heads, "
                f"got {h}")
    if topk > MAX_TOPK:
        return f"implementation='cuda' supports topk <= {MAX_TOPK}, got {topk}"
    if s_kv > MAX_S_KV:
        return f"implementation='cuda' supports S_kv <= {MAX_S_KV}, got {s_kv}"
    return None


def supported(call: TopkCall) -> str | None:
    """Why ``"cuda"`` cannot take ``call``: the compiled sizes first (told even where the module
    is not built), then the build, then the GPU."""
    why = shape_error(call.dtype, call.index_n_heads, call.index_head_dim, call.s_kv, call.topk)
    if why:
        return why
    return module_error() or sm90_device_error()


def topk_call(q, k, weights, q_pos, kv_pos, q_seg, kv_seg, topk: int, k_scale=None,
              with_scores: bool = False):
    """The custom call itself: ``(indices [NB, S_q, topk] int32, workspace uint8, scores)``
    with ``scores [NB, S_q, topk]`` float32 (the selected keys' scores, ``-inf`` on ``-1``
    slots) when ``with_scores``, else ``[0, 0, 0]``. The workspace holds the last chunk's
    scores (a debugging aid: rows ``[0, rows)`` of ``[chunk_rows, ld]`` float32, valid inside
    each row's range). ``q`` and ``k`` are rounded to bfloat16; with ``k_scale [NB, S_kv]``
    they are float8_e4m3fn and each key row is multiplied by its (power-of-two) scale first:
    both are exact in bfloat16, so the kernel's products are the fp8 products times the key's
    scale, exactly."""
    nb, s_q, h, d = q.shape
    s_kv = k.shape[1]
    fp8 = k_scale is not None
    why = shape_error(weights.dtype if fp8 else jnp.result_type(q, k, weights), h, d, s_kv, topk)
    if why:
        raise ValueError("indexer_topk: " + why)
    missing = module_error()
    if missing is not None:
        raise NotImplementedError("indexer_topk: " + missing)
    if fp8:  # e4m3 times 2^e: exact in bfloat16 (8 bits of mantissa, float32's exponents)
        k = k.astype(jnp.float32) * k_scale.astype(jnp.float32)[..., None]
    operands = _kernel_operands(q, k, weights, q_pos, kv_pos, q_seg, kv_seg)
    rows = chunk_rows(s_q, s_kv)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((nb, s_q, topk), jnp.int32),
         jax.ShapeDtypeStruct((workspace_bytes(s_kv, rows),), jnp.uint8),
         jax.ShapeDtypeStruct((nb, s_q, topk) if with_scores else (0, 0, 0), jnp.float32)),
        vmap_method="sequential",
    )
    return call(*operands, chunk_rows=np.int64(rows))


def _kernel_operands(q, k, weights, q_pos, kv_pos, q_seg, kv_seg):
    """The score kernel's operands: bf16 ``q``, ``k`` with the heads padded (zero q and zero
    weight: each padded head adds exactly 0), float32 weights, int32 positions and segment ids
    (zeros for none)."""
    h = q.shape[2]
    hp = padded_heads(h)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    weights = weights.astype(jnp.float32)
    if hp > h:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, 0), (0, hp - h)))
    i32 = jnp.int32
    if q_seg is None:
        q_seg = jnp.zeros(q_pos.shape, i32)
        kv_seg = jnp.zeros(kv_pos.shape, i32)
    return (q, k, weights, q_pos.astype(i32), kv_pos.astype(i32), q_seg.astype(i32),
            kv_seg.astype(i32))


def index_lse_workspace_bytes(s_kv: int, s_q: int) -> int:
    """Bytes of :func:`index_lse_call`'s workspace (ffi/cuda/indexer_topk/launch.h
    IndexLseWorkspaceBytes): partials ``[max(S_q, 8192)]`` float2, row ranges ``[S_q]`` int2,
    key-tile stats ``[ld / 64]`` int4, each 256-byte aligned."""
    ld = _round_up(s_kv, KEY_TILE)
    return (_round_up(max(s_q, 8192) * 8, 256) + _round_up(s_q * 8, 256)
            + _round_up(ld // KEY_TILE * 16, 256))


def index_lse_call(q, k, weights, q_pos, kv_pos, q_seg, kv_seg):
    """``log sum_s exp(I[t, s])`` over each query's visible keys, ``[NB, S_q]`` float32 (``-inf``
    for a query that sees no key), with the scores ``I`` of :func:`topk_call` (the same kernel,
    bitwise the same scores, none stored: memory O(S)). Shapes as :func:`topk_call`; no top-k
    limit applies. The dense indexer KL loss's normaliser."""
    nb, s_q, h, d = q.shape
    s_kv = k.shape[1]
    why = shape_error(jnp.result_type(q, k, weights), h, d, s_kv, 1)
    if why:
        raise ValueError("indexer_kl_loss: " + why)
    missing = module_error()
    if missing is not None:
        raise NotImplementedError("indexer_kl_loss: " + missing)
    call = jax.ffi.ffi_call(
        LSE_TARGET,
        (jax.ShapeDtypeStruct((nb, s_q), jnp.float32),
         jax.ShapeDtypeStruct((index_lse_workspace_bytes(s_kv, s_q),), jnp.uint8)),
        vmap_method="sequential",
    )
    return call(*_kernel_operands(q, k, weights, q_pos, kv_pos, q_seg, kv_seg))[0]


def forward(q, k, weights, q_pos, kv_pos, q_seg, kv_seg, k_scale, config: TopkConfig):
    """``[NB, S_q, config.topk]`` int32 key indices on flattened batches (segment ids may be
    ``None``): descending score, ties to the lower key index, ``-1`` past the visible keys;
    with ``config.scores`` also their scores (``-inf`` on ``-1``). ``k_scale [NB, S_kv]``: fp8
    ``q``/``k`` (see :func:`topk_call`)."""
    idx, _, scores = topk_call(q, k, weights, q_pos, kv_pos, q_seg, kv_seg, config.topk, k_scale,
                               with_scores=config.scores)
    return (idx, scores) if config.scores else (idx,)


IMPLEMENTATION = Implementation("cuda", supported, forward, platforms=("gpu",))
