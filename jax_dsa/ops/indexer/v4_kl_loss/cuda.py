"""The ``"cuda"`` implementation of ``v4_indexer_kl_loss`` on SM90 GPUs, sparse and dense forms.

DeepSeek V4's target differs from V3.2's only in the per-head denominators: they are given
(``attention_lse``: window + compressed slots + sink) instead of the softmax over the row's
support. So the forward kernel runs in its given-denominator mode (FFI target
``jax_dsa_indexer_v4_kl_fwd_cuda``, ``ffi/cuda/indexer_kl_loss/``, contract in ``launch.h``):
one pass over the gathered rows, no per-head statistics and no cluster exchange. Per query row
and slot it writes

* the LOG of the target's unnormalised mass per 64-head group,
  ``log sum_{h in group} exp(sm_scale * q[t, h] . kv[idx] - attention_lse[t, h])`` (``-inf`` off
  the support), computed with the slot's max over the heads subtracted, so that a compressed
  mass that underflows float32 next to the window and sink mass (1e-30 and less) stays exact;
* the index score ``I = sum_hi w * relu(iq . ik[idx])`` (``-inf`` off the support).

XLA log-sum-exps the groups and, under tensor parallelism (``layout.heads``), the head shards
(``pmax`` then ``psum``, :func:`~jax_dsa.sharding.partition.head_logsumexp`), normalises per row
in log space (the row's total mass; the ``1/H`` of the head mean cancels) and forms the KL; the
backward is :mod:`~jax_dsa.ops.indexer.kl_loss.cuda`'s: ``dI = g * (softmax(I) * sum(p) - p)``
into the same backward kernel (``jax_dsa_indexer_kl_bwd_cuda``). No ``[S_q, K, D]`` array is
formed in XLA.

The dense form (``indices=None``: every visible compressed entry, the warm-up stage) runs the same
two kernels over :func:`jax_dsa.ops.indexer.kl_loss.cuda.scan_dense_chunks`' chunks of 2048
entries. The forward keeps flash-style row statistics in log space across the chunks: the
target's running max and sum of ``exp(log_t)``, ``sum exp(log_t) (log_t - I)`` rescaled with
them, and the index score's running log-sum-exp; ``KL = cross / Z - log Z + lse_I``. It saves
``log Z`` and ``lse_I`` per row for the backward, one more pass (forward kernel, then the
backward kernel per chunk with ``dI = g * (exp(I - lse_I) - exp(log_t - log Z))``). No buffer is
larger than ``[S_q, 2048]``.

Precision and limits: as :mod:`~jax_dsa.ops.indexer.kl_loss.cuda` (``q``, ``kv``, ``index_q``,
``index_k`` rounded to bfloat16, ``index_weights`` and ``attention_lse`` float32, float32
accumulation; ``D_qk`` 512 or 576, ``index_head_dim`` 128, ``H <= 128`` local heads,
``index_n_heads <= 64``, ``K <= 2048`` in the sparse form, an SM90 GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.visibility import masked_log_softmax
from jax_dsa.ops.indexer.kl_loss.config import KLCall, KLConfig
from jax_dsa.ops.indexer.kl_loss.cuda import (
    HEAD_GROUP,
    MAX_HEADS,
    MODULE,
    exp_from,
    scan_dense_chunks,
)
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error
from jax_dsa.sharding.partition import head_logsumexp

FWD_TARGET = "jax_dsa_indexer_v4_kl_fwd_cuda"
BWD_TARGET = kl_loss_cuda.BWD_TARGET


def module_error():
    """Why the ``_cuda_indexer`` module is not available in this install (None when loaded)."""
    return native_unavailable("cuda", MODULE)


def supported(call: KLCall) -> str | None:
    """Why ``"cuda"`` cannot take ``call``: the form and shapes first (told even where the
    kernels are not built), then the build, then the GPU."""
    return kl_loss_cuda.support_error(call) or module_error() or sm90_device_error()


# --------------------------------------------------------------------------------------------
# The kernels' calls (flat rows: T = NB * S_q, NB * S_kv keys)


def forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx, *, sm_scale):
    """The forward kernel (V4 mode) on flattened batches: ``(log_mass [ceil(H / 64), NB, S_q,
    K], score [NB, S_q, K])`` float32 (see the module docstring; ``-inf`` marks slots off the
    support in both)."""
    nb, s_q, h, d = q.shape
    s_kv, k = kv.shape[1], idx.shape[-1]
    t, groups = nb * s_q, -(-h // HEAD_GROUP)
    o = kl_loss_cuda._flat_operands(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, idx)
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((groups, t, k), jnp.float32),
         jax.ShapeDtypeStruct((t, k), jnp.float32)),
        vmap_method="sequential",
    )
    log_mass, score = call(
        q.astype(jnp.bfloat16).reshape(t, h, d), kv.astype(jnp.bfloat16).reshape(nb * s_kv, d),
        o["iq"], o["ik"], o["iw"], o["idx"], o["q_pos"], o["kv_pos"], o["q_seg"], o["kv_seg"],
        lse.astype(jnp.float32).reshape(t, h),
        sm_scale=np.float32(sm_scale), s_q=np.int64(s_q), s_kv=np.int64(s_kv))
    return log_mass.reshape(groups, nb, s_q, k), score.reshape(nb, s_q, k)


# --------------------------------------------------------------------------------------------
# The implementation (the contract of kl_loss/vjp.py)


def _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx, config):
    """``(log_p, p)`` of the target ``[NB, S_q, K]`` (over every head shard; ``log_p`` 0 and
    ``p`` 0 off the support), the index score (``-inf`` off the support) and the support."""
    log_mass, score = forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx,
                                     sm_scale=config.sm_scale)
    support = score != -jnp.inf
    log_t = head_logsumexp(log_mass, 0, layout)  # groups, then head shards (pmax, psum)
    log_p = masked_log_softmax(jnp.where(support, log_t, 0), support)
    # A slot whose mass underflows float32 even relative to the row's largest: p = 0 (its
    # log_p is -inf); left out of the KL sum below.
    p = jnp.where(support, jnp.exp(log_p), 0)
    return log_p, p, score, support


def _chunk_target(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx, config):
    """One dense chunk: the target's log mass ``log_t`` (every head shard's; -inf off the
    support) and the index score (-inf off it)."""
    log_mass, score = forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx,
                                     sm_scale=config.sm_scale)
    log_t = head_logsumexp(log_mass, 0, layout)
    return jnp.where(score != -jnp.inf, log_t, -jnp.inf), score


def _dense_forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, config):

    def step(carry, idx, n):
        mt, zt, cross, mi, zi = carry
        log_t, score = _chunk_target(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv,
                                     lse, idx, config)
        new_t = jnp.maximum(mt, jnp.max(log_t, axis=-1))
        scale = exp_from(mt, new_t)
        w = exp_from(log_t, new_t[..., None])
        pos = w > 0
        term = jnp.sum(jnp.where(pos, w * (log_t - jnp.where(pos, score, 0)), 0), axis=-1)
        cross = cross * scale + term
        zt = zt * scale + jnp.sum(w, axis=-1)
        new_i = jnp.maximum(mi, jnp.max(score, axis=-1))
        zi = zi * exp_from(mi, new_i) + jnp.sum(exp_from(score, new_i[..., None]), axis=-1)
        return new_t, zt, cross, new_i, zi

    rows = iq.shape[:2]
    zero, ninf = jnp.zeros(rows, jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32)
    (mt, zt, cross, mi, zi), count = scan_dense_chunks(
        q_pos, kv_pos, q_seg, kv_seg, kv.shape[1], step, (ninf, zero, zero, ninf, zero))
    ok = (count > 0) & (zt > 0)
    log_z = jnp.where(ok, mt + jnp.log(jnp.where(ok, zt, 1)), 0)
    lse_i = jnp.where(ok, mi + jnp.log(jnp.where(ok, zi, 1)), 0)
    # KL = sum p (log_t - log Z - I + lse_I) with p = exp(log_t - log Z)
    kl = jnp.where(ok, cross / jnp.where(ok, zt, 1) - log_z + lse_i, 0)
    has = count > 0
    return (jnp.sum(kl, axis=-1), jnp.sum(has.astype(jnp.int32), axis=-1),
            jnp.stack([log_z, lse_i], axis=-1))


def _dense_backward(layout, g, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, config,
                    residuals):
    log_z, lse_i = residuals[..., 0], residuals[..., 1]
    g = g.astype(jnp.float32)[:, None, None]

    def step(carry, idx, n):
        log_t, score = _chunk_target(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv,
                                     lse, idx, config)
        support = score != -jnp.inf
        p = exp_from(log_t, log_z[..., None])
        pi = exp_from(score, lse_i[..., None])
        dscore = jnp.where(support, g * (pi - p), 0)
        grads = kl_loss_cuda.backward_kernel(iq, ik, iw, idx, dscore, config.deterministic)
        return tuple(a + b for a, b in zip(carry, grads))

    f32 = jnp.float32
    init = (jnp.zeros(iq.shape, f32), jnp.zeros(ik.shape, f32), jnp.zeros(iw.shape, f32))
    grads, _ = scan_dense_chunks(q_pos, kv_pos, q_seg, kv_seg, kv.shape[1], step, init)
    return grads


def _check(q):
    if q.shape[2] > MAX_HEADS:
        raise ValueError(f"v4_indexer_kl_loss: implementation='cuda' takes at most {MAX_HEADS} "
                         f"local heads, got {q.shape[2]}")


def forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx,
            config: KLConfig):
    """Per batch element of this shard: ``(kl_sum [NB], row_count [NB])`` over its rows (and
    for the dense form, ``idx`` None, the backward's residuals ``[NB, S_q, 2]``)."""
    _check(q)
    if idx is None:
        return _dense_forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse,
                              config)
    log_p, p, score, support = _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg,
                                                 kv_seg, q, kv, lse, idx, config)
    log_pi = masked_log_softmax(score, support)
    pos = support & (p > 0)
    kl = jnp.sum(jnp.where(pos, p * (jnp.where(pos, log_p, 0) - log_pi), 0), axis=-1)
    has = jnp.any(support, axis=-1)
    return (jnp.sum(jnp.where(has, kl, 0), axis=-1),
            jnp.sum(has.astype(jnp.int32), axis=-1))


def backward(layout, g, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx,
             config: KLConfig, residuals=None):
    """``(d index_q, d index_k, d index_weights)`` in float32 for cotangent ``g [NB]`` of the
    KL sums (``d index_k`` a partial sum over this shard's rows)."""
    _check(q)
    if idx is None:
        return _dense_backward(layout, g, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse,
                               config, residuals)
    _, p, score, support = _target_and_score(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg,
                                             q, kv, lse, idx, config)
    pi = jnp.where(support, jnp.exp(masked_log_softmax(score, support)), 0)
    total = jnp.sum(p, axis=-1, keepdims=True)  # 1 on rows with a support (up to rounding)
    g = g.astype(jnp.float32)[:, None, None]
    dscore = jnp.where(support, g * (pi * total - p), 0)
    return kl_loss_cuda.backward_kernel(iq, ik, iw, idx, dscore, config.deterministic)


IMPLEMENTATION = Implementation("cuda", supported, forward, backward, platforms=("gpu",))
