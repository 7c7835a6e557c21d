"""Test doubles of the CUDA kernels: each FFI call's contract in pure JAX, float32 on bf16-rounded
operands (gathers ``[NB, S_q, K, D]``: small shapes only).

Tests monkeypatch them over the production module's functions (``monkeypatch.setattr(
kl_loss_cuda, "forward_kernel", cuda_doubles.kl_forward_kernel)``) to run the XLA glue around
the kernels on any machine; the ``gpu`` tests check the kernels against them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.indexer.kl_loss.cuda import HEAD_GROUP
from jax_dsa.ops.visibility import masked_log_softmax, visible_mask

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST


def _bf(x):
    return x.astype(BF16).astype(F32)


def _take(a, i):
    return jax.vmap(lambda a, i: a[i])(a, i)


# ---------------------------------------------------------------------------------------------
# jax_dsa.ops.indexer.kl_loss.cuda


def kl_forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx, *, sm_scale):
    """``kl_loss_cuda.forward_kernel``: ``(mass [ceil(H / 64), NB, S_q, K], score [NB, S_q,
    K])``."""
    nb, s_q, h, d = q.shape
    s_kv = kv.shape[1]
    groups = -(-h // HEAD_GROUP)
    support, safe = kl_loss_cuda._support(kv_pos, q_pos, q_seg, kv_seg, idx, s_kv)
    rows = _take(_bf(kv), safe)  # [nb, s_q, k, d]
    logits = jnp.einsum("bshd,bskd->bshk", _bf(q), rows, precision=HIGHEST) * sm_scale
    p_h = jnp.exp(masked_log_softmax(logits, support[:, :, None, :]))
    p_h = jnp.where(support[:, :, None, :], p_h, 0)
    p_h = jnp.pad(p_h, ((0, 0), (0, 0), (0, groups * HEAD_GROUP - h), (0, 0)))
    mass = jnp.sum(p_h.reshape(nb, s_q, groups, HEAD_GROUP, -1), axis=3).transpose(2, 0, 1, 3)
    krow = _take(_bf(ik), safe)
    dots = jnp.einsum("bshd,bskd->bshk", _bf(iq), krow, precision=HIGHEST)
    score = jnp.sum(jax.nn.relu(dots) * iw.astype(F32)[..., None], axis=2)
    return mass, jnp.where(support, score, -jnp.inf)


def kl_score_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx):
    """``kl_loss_cuda.score_kernel``: the index score ``[NB, S_q, K]``."""
    return kl_forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q[:, :, :1], kv, idx,
                             sm_scale=1.0)[1]


def kl_target_kernel(q, kv, idx, lse, *, sm_scale, topk_length=None):
    """``kl_loss_cuda.target_kernel`` (writes every slot, so ``topk_length`` is not needed)."""
    del topk_length
    s_kv = kv.shape[1]
    valid = (idx >= 0) & (idx < s_kv)
    rows = _take(_bf(kv), jnp.where(valid, idx, 0))
    logits = jnp.einsum("bshd,bskd->bshk", _bf(q), rows, precision=HIGHEST) * sm_scale
    mass = jnp.sum(jnp.exp(logits - lse.astype(F32)[..., None]), axis=2)
    return jnp.where(valid, mass, 0)


def kl_dense_lse_kernel(q, kv, q_pos, kv_pos, q_seg, kv_seg, *, sm_scale):
    """``kl_loss_cuda.dense_lse_kernel`` (``[NB, S_q, H, S_kv]`` logits)."""
    logits = jnp.einsum("bshd,btd->bsht", _bf(q), _bf(kv), precision=HIGHEST) * sm_scale
    vis = visible_mask(q_pos, kv_pos, q_seg, kv_seg)[:, :, None, :]
    lse = jax.nn.logsumexp(jnp.where(vis, logits, -jnp.inf), axis=-1)
    return jnp.where(jnp.any(vis, axis=-1), lse, jnp.inf)


def kl_index_lse_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg):
    """``kl_loss_cuda.index_lse_kernel`` (``[NB, S_q, H_I, S_kv]`` dots)."""
    dots = jnp.einsum("bshd,btd->bsht", _bf(iq), _bf(ik), precision=HIGHEST)
    score = jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots), iw.astype(F32), precision=HIGHEST)
    vis = visible_mask(q_pos, kv_pos, q_seg, kv_seg)
    return jax.nn.logsumexp(jnp.where(vis, score, -jnp.inf), axis=-1)


def kl_backward_kernel(iq, ik, iw, idx, dscore, deterministic=False):
    """``kl_loss_cuda.backward_kernel``: ``(d_iq, d_ik, d_w)`` (the same in either mode)."""
    del deterministic
    nb, s_q, h_i, d_i = iq.shape
    s_kv = ik.shape[1]
    valid = (idx >= 0) & (idx < s_kv)
    safe = jnp.where(valid, idx, 0)
    ds = jnp.where(valid, dscore.astype(F32), 0)
    iqf, ikf = _bf(iq), _bf(ik)
    krow = _take(ikf, safe)
    dots = jnp.einsum("bshd,bskd->bshk", iqf, krow, precision=HIGHEST)
    d_w = jnp.einsum("bsk,bshk->bsh", ds, jax.nn.relu(dots), precision=HIGHEST)
    gmat = ds[:, :, None, :] * iw.astype(F32)[..., None] * (dots > 0)
    d_iq = jnp.einsum("bshk,bskd->bshd", gmat, krow, precision=HIGHEST)
    u = jnp.einsum("bshk,bshd->bskd", gmat, iqf, precision=HIGHEST)
    d_ik = jax.vmap(lambda z, i, x: z.at[i].add(x))(
        jnp.zeros_like(ikf), safe.reshape(nb, -1), u.reshape(nb, -1, d_i))
    return d_iq, d_ik, d_w


def kl_dense_backward_kernel(iq, ik, iw, idx, target, index_lse, deterministic=False):
    """``kl_loss_cuda.dense_backward_kernel``: ``(d_iq, d_ik, d_w, score)`` (either mode)."""
    del deterministic
    s_kv = ik.shape[1]
    valid = (idx >= 0) & (idx < s_kv)
    zeros = jnp.zeros  # positions that make every valid slot visible
    score = kl_score_kernel(iq, ik, iw, zeros(idx.shape[:2], jnp.int32),
                            zeros((idx.shape[0], s_kv), jnp.int32), None, None,
                            iq[..., :1], ik[..., :1], idx)
    dscore = jnp.where(valid, jnp.exp(score - index_lse[..., None]) - target, 0)
    return kl_backward_kernel(iq, ik, iw, idx, dscore) + (score,)


KL_KERNELS = {"forward_kernel": kl_forward_kernel, "backward_kernel": kl_backward_kernel,
              "score_kernel": kl_score_kernel, "target_kernel": kl_target_kernel,
              "dense_lse_kernel": kl_dense_lse_kernel, "index_lse_kernel": kl_index_lse_kernel,
              "dense_backward_kernel": kl_dense_backward_kernel}


# ---------------------------------------------------------------------------------------------
# jax_dsa.ops.indexer.v4_kl_loss.cuda


def v4_forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx, *, sm_scale):
    """``v4_kl_loss_cuda.forward_kernel``: ``(log_mass [ceil(H / 64), NB, S_q, K], score)``."""
    nb, s_q, h, d = q.shape
    s_kv = kv.shape[1]
    groups = -(-h // HEAD_GROUP)
    support, safe = kl_loss_cuda._support(kv_pos, q_pos, q_seg, kv_seg, idx, s_kv)
    rows = _take(_bf(kv), safe)  # [nb, s_q, k, d]
    logits = jnp.einsum("bshd,bskd->bshk", _bf(q), rows, precision=HIGHEST) * sm_scale
    log_ph = jnp.where(support[:, :, None, :], logits - lse.astype(F32)[..., None], -jnp.inf)
    log_ph = jnp.pad(log_ph, ((0, 0), (0, 0), (0, groups * HEAD_GROUP - h), (0, 0)),
                     constant_values=-jnp.inf)
    log_mass = jax.nn.logsumexp(log_ph.reshape(nb, s_q, groups, HEAD_GROUP, -1), axis=3)
    _, score = kl_forward_kernel(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q[:, :, :1], kv, idx,
                                 sm_scale=sm_scale)
    return log_mass.transpose(2, 0, 1, 3), score


# ---------------------------------------------------------------------------------------------
# jax_dsa.ops.sparse_mla.cuda


def backward_rows(q, kv, out, dout, lse, sink, rows, length, *, sm_scale, deterministic=False):
    """``sparse_mla.cuda.cuda_backward_rows`` (either backward kernel on flat rows): ``(dq, dkv,
    d_sink)`` float32 (gathers ``[T, Kb, D_qk]``)."""
    del deterministic
    d_v = out.shape[-1]
    valid = (rows >= 0) & (jnp.arange(rows.shape[1]) < length[:, None])
    safe = jnp.where(valid, rows, 0)
    kr = kv.astype(F32)[safe]

    def ein(spec, a, b):
        return jnp.einsum(spec, a, b, precision=HIGHEST)

    qf, of, dof = q.astype(F32), out.astype(F32), dout.astype(F32)
    lse = jnp.logaddexp(lse, sink)
    p = jnp.where(valid[:, None], jnp.exp(ein("thd,tkd->thk", qf, kr) * sm_scale - lse[..., None]),
                  0)
    delta = jnp.sum(dof * of, axis=-1)
    ds = p * (ein("thv,tkv->thk", dof, kr[..., :d_v]) - delta[..., None])
    dq = ein("thk,tkd->thd", ds, kr) * sm_scale
    dk = ein("thk,thd->tkd", ds, qf) * sm_scale
    dk = dk.at[..., :d_v].add(ein("thk,thv->tkv", p, dof))
    dkv = jnp.zeros(kv.shape, F32).at[safe.reshape(-1)].add(
        jnp.where(valid[..., None], dk, 0).reshape(-1, kv.shape[1]))
    return dq, dkv, -jnp.sum(jnp.exp(sink - lse) * delta, axis=0)
