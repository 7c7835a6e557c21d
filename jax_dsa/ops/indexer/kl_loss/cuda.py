"""The ``"cuda"`` implementation of ``indexer_kl_loss``: the sparse form on SM90 GPUs.

Two CUDA C++ kernels of the ``_cuda_indexer`` FFI module (``ffi/cuda/indexer_kl_loss/``; the
contract in ``launch.h``) do the work that needs the ``[S_q, K, D]`` gathered rows; the KL
algebra on small ``[S_q, K]`` float32 arrays stays in XLA here, so no ``[S_q, K, D]`` array is
ever formed:

* the forward kernel (``jax_dsa_indexer_kl_fwd_cuda``) writes, per query row and slot, the
  target's unnormalised mass ``sum_{h local} softmax_h(sm_scale * q[t, h] . kv[idx])`` (0 off the
  support) and the index score ``I = sum_hi w * relu(iq . ik[idx])`` (``-inf`` off the support);
* XLA sums the mass over head groups and, under tensor parallelism (``layout.heads``), over the
  head shards (``psum``), divides by the total ``H``, and forms the KL and the row counts;
* the backward recomputes the forward kernel (under ``jax.value_and_grad`` XLA merges the two
  identical calls), forms ``dI = g * (softmax(I) * sum(p) - p)`` on the support and hands it to
  the backward kernel (``jax_dsa_indexer_kl_bwd_cuda``), which writes ``d index_q``,
  ``d index_weights`` and ``d index_k`` (fp32 vector atomics) in float32.

With ``attention_lse`` given (the main attention's denominators over the same slots, e.g.
``sparse_mla``'s lse), the target comes from the attention forward kernel's target mode instead
(``jax_dsa.ops.sparse_mla.cuda.cuda_target``: ``Q K^T`` on wgmma tensor cores, one pass, mass
``sum_h exp(sm_scale * q . kv - lse)``; module ``_cuda``), renormalised over the support, and
the index score from kernel A's score-only launch (``jax_dsa_indexer_score_cuda``), or, with
``index_scores`` given too (the top-k's scores of the slots), from those: no score kernel then.

Precision: ``q``, ``kv``, ``index_q`` and ``index_k`` are rounded to bfloat16 (the kernels'
operands; ``KLCall.dtype`` is the promoted dtype of all float inputs, float32 with float32
weights), ``index_weights`` stays float32, every product accumulates in float32. In the backward
``G = dI * w * 1[iq . ik > 0]`` is rounded to bfloat16 for its two tensor-core products.

The dense form (``indices=None``, the warm-up stage) runs over chunks of ``CHUNK`` key columns
(``lax.scan``): each query's visible keys, ordered by (segment, position) as in
:func:`jax_dsa.ops.dense_mla.cuda.dense_runs`, cut into chunks of 2048 that serve as slot lists
(valid slots first, the target kernel stopping at each row's count, the backward kernel skipping
empty tiles). No buffer is larger than ``[S_q, CHUNK]``. The denominators are ``attention_lse``
when given (``dense_mla``'s lse), else the dense attention forward's
(``jax_dsa.ops.dense_mla.cuda.cuda_dense_forward``). Under differentiation
(:func:`forward_with_grads`) the loss and the gradients come from two passes over the keys:
first the index scores' log-sum-exp per row (``lse_I``; the top-k's score kernel storing no
scores), then per chunk the target kernel and the backward kernel's dense form, which forms
``dscore = exp(I - lse_I) - p`` from the scores it recomputes and returns them for the loss. The
target ``p`` is the head sum of ``exp(sm_scale * q . kv - lse)`` divided by ``H``: each head's
distribution over the visible keys sums to 1, so ``attention_lse`` must be the denominators over
exactly those keys (no attention sink). The forward alone (no gradient) runs the same passes.

Limits: ``D_qk`` 512 or 576, ``index_head_dim`` 128, ``H <= 128`` (local heads),
``index_n_heads <= 64``, ``K <= 2048`` (sparse form), an SM90 GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa.ops.dense_mla.cuda import cuda_dense_forward, dense_runs
from jax_dsa.ops.visibility import masked_log_softmax
from jax_dsa.ops.indexer.kl_loss.config import KLCall
from jax_dsa.ops.indexer.topk.cuda import index_lse_call
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error
from jax_dsa.ops.sparse_mla.cuda import cuda_target

FWD_TARGET = "jax_dsa_indexer_kl_fwd_cuda"
SCORE_TARGET = "jax_dsa_indexer_score_cuda"
BWD_TARGET = "jax_dsa_indexer_kl_bwd_cuda"
DENSE_BWD_TARGET = "jax_dsa_indexer_kl_dense_bwd_cuda"
# The deterministic mode's (d index_k in 64-bit fixed point): one more operand and result.
BWD_DET_TARGET = "jax_dsa_indexer_kl_bwd_det_cuda"
DENSE_BWD_DET_TARGET = "jax_dsa_indexer_kl_dense_bwd_det_cuda"
MODULE = "_cuda_indexer"
KERNEL_D_QK = (512, 576)
INDEX_HEAD_DIM = 128
MAX_HEADS = 128
MAX_INDEX_HEADS = 64
MAX_TOPK = 2048
HEAD_GROUP = 64  # main heads per forward CTA tile: the mass comes per group of 64
CHUNK = MAX_TOPK  # key columns per pass of the dense form

def module_error():
    """Why the ``_cuda_indexer`` module is not available in this install (None when loaded)."""
    return native_unavailable("cuda", MODULE)


def support_error(call: KLCall) -> str | None:
    """Why the kernels cannot take ``call`` (its shapes and dtype), or None."""
    if call.d_qk not in KERNEL_D_QK:
        return f"implementation='cuda' supports D_qk in {KERNEL_D_QK}, got {call.d_qk}"
    if call.index_head_dim != INDEX_HEAD_DIM:
        return (f"implementation='cuda' supports index_head_dim {INDEX_HEAD_DIM}, got "
                f"{call.index_head_dim}")
    if call.index_n_heads > MAX_INDEX_HEADS:
        return (f"implementation='cuda' supports at most {MAX_INDEX_HEADS} index heads, got "
                f"{call.index_n_heads}")
    if call.h > MAX_HEADS:
        return f"implementation='cuda' supports at most {MAX_HEADS} heads, got H={call.h}"
    if call.topk is not None and call.topk > MAX_TOPK:
        return f"implementation='cuda' supports at most {MAX_TOPK} slots (K), got {call.topk}"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return (f"implementation='cuda' computes in float32 from bfloat16 operands; got "
                f"{jnp.dtype(call.dtype)} inputs (use 'xla' for float64)")
    return None


def supported(call: KLCall) -> str | None:
    """Why ``"cuda"`` cannot take ``call``: the form and shapes first (told even where the
    kernels are not built), then the build, then the GPU."""
    return (support_error(call) or module_error()
            or (native_unavailable("cuda", "_cuda") if call.given_lse or call.topk is None
                else None)
            or sm90_device_error())


# --------------------------------------------------------------------------------------------
# The kernels' calls (flat rows: T = NB * S_q, NB * S_kv keys)


def _flat_operands(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, idx):
    nb, s_q, h_i, d_i = iq.shape
    s_kv = ik.shape[1]
    t = nb * s_q
    bf = jnp.bfloat16
    if q_seg is None:
        q_seg = jnp.zeros((0,), jnp.int32)
        kv_seg = jnp.zeros((0,), jnp.int32)
    else:
        q_seg = q_seg.astype(jnp.int32).reshape(t)
        kv_seg = kv_seg.astype(jnp.int32).reshape(nb * s_kv)
    return dict(
        iq=iq.astype(bf).reshape(t, h_i, d_i), ik=ik.astype(bf).reshape(nb * s_kv, d_i),
        iw=iw.astype(jnp.float32).reshape(t, h_i),
        idx=idx.astype(jnp.int32).reshape(t, idx.shape[-1]),  # (K explicit: t may be 0)
        q_pos=q_pos.astype(jnp.int32).reshape(t), kv_pos=kv_pos.astype(jnp.int32).reshape(-1),
        q_seg=q_seg, kv_seg=kv_seg)


def forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx, *, sm_scale):
    """The forward kernel on flattened batches: ``(mass [ceil(H / 64), NB, S_q, K], score
    [NB, S_q, K])`` float32 (see the module docstring; ``-inf`` score marks slots off the
    support)."""
    nb, s_q, h, d = q.shape
    s_kv, k = kv.shape[1], idx.shape[-1]
    t, groups = nb * s_q, -(-h // HEAD_GROUP)
    o = _flat_operands(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, idx)
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((groups, t, k), jnp.float32),
         jax.ShapeDtypeStruct((t, k), jnp.float32)),
        vmap_method="sequential",
    )
    mass, score = call(q.astype(jnp.bfloat16).reshape(t, h, d),
                       kv.astype(jnp.bfloat16).reshape(nb * s_kv, d), o["iq"], o["ik"], o["iw"],
                       o["idx"], o["q_pos"], o["kv_pos"], o["q_seg"], o["kv_seg"],
                       sm_scale=np.float32(sm_scale), s_q=np.int64(s_q), s_kv=np.int64(s_kv))
    return mass.reshape(groups, nb, s_q, k), score.reshape(nb, s_q, k)


def score_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx):
    """Kernel A's score-only launch: the index score ``[NB, S_q, K]`` float32 (``-inf`` off the
    support). ``q`` and ``kv`` are passed for their shapes only (not read)."""
    nb, s_q, h, d = q.shape
    s_kv, k = kv.shape[1], idx.shape[-1]
    t = nb * s_q
    o = _flat_operands(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, idx)
    call = jax.ffi.ffi_call(SCORE_TARGET, jax.ShapeDtypeStruct((t, k), jnp.float32),
                            vmap_method="sequential")
    score = call(q.astype(jnp.bfloat16).reshape(t, h, d),
                 kv.astype(jnp.bfloat16).reshape(nb * s_kv, d), o["iq"], o["ik"], o["iw"],
                 o["idx"], o["q_pos"], o["kv_pos"], o["q_seg"], o["kv_seg"],
                 sm_scale=np.float32(1.0), s_q=np.int64(s_q), s_kv=np.int64(s_kv))
    return score.reshape(nb, s_q, k)


def target_kernel(q, kv, idx, lse, *, sm_scale, topk_length=None):
    """The target's unnormalised head sum ``[NB, S_q, K]`` from given denominators (the
    attention kernel's target mode; slots past ``topk_length [NB, S_q]`` are skipped and their
    mass left unwritten)."""
    return cuda_target(q, kv, idx, lse, sm_scale=sm_scale, topk_length=topk_length)


def dense_lse_kernel(q, kv, q_pos, kv_pos, q_seg, kv_seg, *, sm_scale):
    """The dense attention's natural-log denominators ``[NB, S_q, H]`` float32 (+inf for a row
    without visible keys): the dense forward kernel, its output discarded."""
    d_v = 512
    sink = jnp.full((q.shape[2],), -jnp.inf, jnp.float32)
    return cuda_dense_forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, sm_scale=sm_scale,
                              d_v=d_v)[1]


def fixed_point_scale(iq, iw, per_row_mass):
    """The deterministic backward's fixed-point scale: the largest power of two ``2^F`` (``F`` in
    [-100, 100]) with ``bound * 2^F <= 2^62``, where ``bound`` bounds every partial sum of finite
    terms of any ``d_ik`` element: sum over rows of ``per_row_mass[t] * sum_hi |w[t, hi]|``
    (``per_row_mass``: the row's sum of ``|dscore|``) times ``max |iq|``, over the finite
    entries, plus 1% for G's bf16 rounding (the kernel flags the rows given a non-finite term).
    Returns ``scale [1]`` float32."""
    f32 = jnp.float32

    def finite_abs(x):
        x = jnp.abs(x.astype(f32))
        return jnp.where(jnp.isfinite(x), x, 0)

    bound = (jnp.sum(finite_abs(per_row_mass) * jnp.sum(finite_abs(iw), axis=-1))
             * jnp.max(finite_abs(iq)) * 1.01)
    # (a bound that overflowed float32 gives log2 = inf: the smallest scale, 2^-100)
    bound = jnp.where(bound > 0, bound, 1.0)
    exp = jnp.clip(jnp.floor(62.0 - jnp.log2(bound)), -100, 100)
    # Exactly 2^exp (exp2 may round): the float32 bit pattern with that biased exponent.
    bits = ((exp.astype(jnp.int32) + 127) << 23).reshape(1)
    return jax.lax.bitcast_convert_type(bits, f32)


def _backward_call(target, iq, ik, iw, idx, per_slot, *extra, score=False, per_row_mass=None):
    """A backward-kernel custom call on flattened batches: ``(d_iq, d_ik, d_w)`` (and with
    ``score`` the slots' scores ``[NB, S_q, K]``) float32, shaped like ``iq``, ``ik``, ``iw``;
    ``per_slot [NB, S_q, K]`` and ``extra`` (``[NB, S_q]`` each) float32 operands.
    ``per_row_mass [NB, S_q]``, for a deterministic target: ``d_ik`` summed in 64-bit fixed
    point (bitwise reproducible), scaled by :func:`fixed_point_scale` of it (a ``d_ik`` row given
    a NaN or inf term is NaN; the float32 atomics give NaN or inf in its affected elements)."""
    nb, s_q, h_i, d_i = iq.shape
    s_kv, k = ik.shape[1], idx.shape[-1]
    t = nb * s_q
    bf, f32 = jnp.bfloat16, jnp.float32
    shapes = ((t, h_i, d_i), (nb * s_kv, d_i), (t, h_i)) + (((t, k),) if score else ())
    results = tuple(jax.ShapeDtypeStruct(x, f32) for x in shapes)
    det = ()
    if per_row_mass is not None:  # the scale, and the fixed-point sums' workspace
        results += (jax.ShapeDtypeStruct((nb * s_kv * (d_i * 8 + 4),), jnp.uint8),)
        det = (fixed_point_scale(iq, iw, per_row_mass),)
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    out = call(iq.astype(bf).reshape(t, h_i, d_i), ik.astype(bf).reshape(nb * s_kv, d_i),
               iw.astype(f32).reshape(t, h_i), idx.astype(jnp.int32).reshape(t, k),
               per_slot.astype(f32).reshape(t, k), *(x.astype(f32).reshape(t) for x in extra),
               *det, s_q=np.int64(s_q), s_kv=np.int64(s_kv))[:len(shapes)]
    shaped = (iq.shape, ik.shape, iw.shape) + ((idx.shape,) if score else ())
    return tuple(o.reshape(x) for o, x in zip(out, shaped))


def backward_kernel(iq, ik, iw, idx, dscore, deterministic=False):
    """The backward kernel on flattened batches: ``(d_iq, d_ik, d_w)`` float32, shaped like
    ``iq``, ``ik``, ``iw``, from ``dscore [NB, S_q, K]`` (0 off the support); ``deterministic``:
    see :func:`_backward_call`."""
    if not deterministic:
        return _backward_call(BWD_TARGET, iq, ik, iw, idx, dscore)
    mass = jnp.sum(jnp.abs(dscore.astype(jnp.float32)), axis=-1)
    return _backward_call(BWD_DET_TARGET, iq, ik, iw, idx, dscore, per_row_mass=mass)


def index_lse_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg):
    """``log sum exp`` of the index scores over each query's visible keys ``[NB, S_q]`` float32
    (``-inf`` for none): the top-k's score kernel with no scores stored
    (:func:`jax_dsa.ops.indexer.topk.cuda.index_lse_call`)."""
    return index_lse_call(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg)


def dense_backward_kernel(iq, ik, iw, idx, target, index_lse, deterministic=False):
    """The backward kernel's dense form: ``(d_iq, d_ik, d_w, score)`` float32 for
    ``dscore = exp(I - index_lse) - target`` on the valid slots of ``idx`` (every one visible),
    ``I`` recomputed by the kernel and returned as ``score [NB, S_q, K]`` (``-inf`` on invalid
    slots); ``target [NB, S_q, K]``, ``index_lse [NB, S_q]``. ``deterministic``: see
    :func:`_backward_call` (``|dscore| <= 1``: a difference of two probabilities)."""
    if not deterministic:
        return _backward_call(DENSE_BWD_TARGET, iq, ik, iw, idx, target, index_lse, score=True)
    mass = jnp.full(index_lse.shape, float(idx.shape[-1]), jnp.float32)
    return _backward_call(DENSE_BWD_DET_TARGET, iq, ik, iw, idx, target, index_lse, score=True,
                          per_row_mass=mass)


def _support(kv_pos, q_pos, q_seg, kv_seg, idx, s_kv):
    valid = (idx >= 0) & (idx < s_kv)
    safe = jnp.where(valid, idx, 0)
    take = jax.vmap(lambda a, i: a[i])
    support = valid & (take(kv_pos, safe) <= q_pos[..., None])
    if q_seg is not None:
        support = support & (take(kv_seg, safe) == q_seg[..., None])
    return support, safe


# --------------------------------------------------------------------------------------------
# The implementation (the contract of kl_loss/vjp.py)


def _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, rest, config):
    """``p [NB, S_q, K]`` (the target, head mean over every shard; 0 off the support) and the
    index score (``-inf`` off the support). ``rest``: the slots after the given operands
    (:meth:`KLConfig.unpack`)."""
    lse, given_scores, idx = config.unpack(rest)
    if config.given_lse:
        if given_scores is None:
            score = score_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx)
        else:  # the top-k's scores: only the support is formed here
            support, _ = _support(kv_pos, q_pos, q_seg, kv_seg, idx, kv.shape[1])
            score = jnp.where(support, given_scores.astype(jnp.float32), -jnp.inf)
        mass = target_kernel(q, kv, idx, lse, sm_scale=config.sm_scale)
    else:
        mass, score = forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx,
                                     sm_scale=config.sm_scale)
        mass = jnp.sum(mass, axis=0)
    if layout.heads:  # heads split over the mesh: the head mean spans every shard
        mass = jax.lax.psum(mass, layout.heads)
    if config.given_lse:  # renormalised over the support (1 up to rounding)
        mass = jnp.where(score != -jnp.inf, mass, 0)
        total = jnp.sum(mass, axis=-1, keepdims=True)
        return mass / jnp.where(total > 0, total, 1), score, idx
    return mass / jnp.float32(config.h), score, idx


def _check(q):
    if q.shape[2] > MAX_HEADS:
        raise ValueError(f"indexer_kl_loss: implementation='cuda' takes at most {MAX_HEADS} local "
                         f"heads, got {q.shape[2]}")


def exp_from(x, m):
    """``exp(x - m)``, 0 where ``x`` is ``-inf`` (also when ``m`` is)."""
    return jnp.where(x == -jnp.inf, 0.0, jnp.exp(x - jnp.where(m == -jnp.inf, 0.0, m)))


def scan_dense_chunks(q_pos, kv_pos, q_seg, kv_seg, s_kv, step, init):
    """Runs ``carry = step(carry, idx, n)`` over the dense form's key chunks (see the module
    docstring): ``idx [NB, S_q, CHUNK']`` the chunk's keys (-1 past a row's ``n [NB, S_q]``).
    Returns ``(carry, visible key count [NB, S_q])``."""
    width = min(CHUNK, s_kv)
    perm, lo, count = dense_runs(q_pos, kv_pos, q_seg, kv_seg)
    cols = jnp.arange(width, dtype=jnp.int32)

    def body(carry, c):
        first = c * width
        n = jnp.clip(count - first, 0, width)
        at = jnp.minimum(lo[..., None] + first + cols, s_kv - 1)
        idx = jnp.where(cols < n[..., None], jax.vmap(lambda p, i: p[i])(perm, at), -1)
        return step(carry, idx, n), None

    carry, _ = jax.lax.scan(body, init, jnp.arange(-(-s_kv // width), dtype=jnp.int32))
    return carry, count


def _dense_forward_with_grads(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse,
                              config):
    """The dense form's loss and gradients in two passes over the keys (see the module
    docstring): the index scores' log-sum-exp, then per chunk the target and the dense
    backward kernel (which recomputes the scores and returns them for the loss)."""
    if lse is None:
        lse = dense_lse_kernel(q, kv, q_pos, kv_pos, q_seg, kv_seg, sm_scale=config.sm_scale)
    lse_i = index_lse_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg)
    lse_i = jnp.where(lse_i == -jnp.inf, 0, lse_i)  # rows without keys: no slot reads it

    def step(carry, idx, n):
        cross, tot, *grads = carry
        mass = target_kernel(q, kv, idx, lse, sm_scale=config.sm_scale, topk_length=n)
        mass = jnp.where(idx >= 0, mass, 0)  # columns past n: unwritten
        if layout.heads:
            mass = jax.lax.psum(mass, layout.heads)
        # Each head's probabilities over the visible keys sum to 1: the head mean is mass / H.
        p = mass / jnp.float32(config.h)
        *chunk_grads, score = dense_backward_kernel(iq, ik, iw, idx, p, lse_i,
                                                    config.deterministic)
        pos = p > 0
        cross = cross + jnp.sum(
            jnp.where(pos, p * (jnp.log(jnp.where(pos, p, 1)) - score), 0), axis=-1)
        return (cross, tot + jnp.sum(p, axis=-1), *(a + b for a, b in zip(grads, chunk_grads)))

    f32 = jnp.float32
    zero = jnp.zeros(iq.shape[:2], f32)
    init = (zero, zero, jnp.zeros(iq.shape, f32), jnp.zeros(ik.shape, f32),
            jnp.zeros(iw.shape, f32))
    (cross, tot, *grads), count = scan_dense_chunks(q_pos, kv_pos, q_seg, kv_seg, kv.shape[1],
                                                    step, init)
    has = count > 0
    # KL = sum p (log p - I + lse_I); its gradient in I is exp(I - lse_I) sum(p) - p, with
    # sum(p) = 1 up to rounding (taken as 1 by the kernel).
    kl = jnp.where(has, cross + lse_i * tot, 0)
    return (jnp.sum(kl, axis=-1), jnp.sum(has.astype(jnp.int32), axis=-1), tuple(grads))


def forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, *rest):
    """Per batch element of this shard: ``(kl_sum [NB], row_count [NB])`` over its rows.
    ``rest``: the slots (after ``attention_lse`` when given; ``None`` in the dense form), then
    the :class:`KLConfig`."""
    *rest, config = rest
    _check(q)
    if rest[-1] is None:  # the same passes as under differentiation, the gradients unused
        return forward_with_grads(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, *rest,
                                  config)[:2]
    p, score, _ = _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv,
                                    rest, config)
    support = score != -jnp.inf
    log_pi = masked_log_softmax(score, support)
    pos = support & (p > 0)
    log_p = jnp.log(jnp.where(pos, p, 1))
    kl = jnp.sum(jnp.where(pos, p * (log_p - log_pi), 0), axis=-1)
    has = jnp.any(support, axis=-1)
    return (jnp.sum(jnp.where(has, kl, 0), axis=-1),
            jnp.sum(has.astype(jnp.int32), axis=-1))


def forward_with_grads(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, *rest):
    """The dense form under differentiation: ``(kl_sum [NB], row_count [NB], (d index_q,
    d index_k, d index_weights))``, the gradients float32 for a unit cotangent of each batch
    element's KL sum (``d index_k`` a partial sum over this shard's rows)."""
    *rest, config = rest
    _check(q)
    lse = rest[0] if config.given_lse else None
    return _dense_forward_with_grads(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse,
                                     config)


def backward(layout, g, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, *rest):
    """The sparse form's ``(d index_q, d index_k, d index_weights)`` in float32 for cotangent
    ``g [NB]`` of the KL sums (``d index_k`` a partial sum over this shard's rows)."""
    *rest, config = rest
    _check(q)
    p, score, idx = _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv,
                                      rest, config)
    support = score != -jnp.inf
    pi = jnp.where(support, jnp.exp(masked_log_softmax(score, support)), 0)
    total = jnp.sum(p, axis=-1, keepdims=True)  # 1 on rows with a support (up to rounding)
    g = g.astype(jnp.float32)[:, None, None]
    dscore = jnp.where(support, g * (pi * total - p), 0)
    return backward_kernel(iq, ik, iw, idx, dscore, config.deterministic)


IMPLEMENTATION = Implementation("cuda", supported, forward, backward, platforms=("gpu",),
                                forward_with_grads=forward_with_grads)
