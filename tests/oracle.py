"""float64 NumPy references of jax_dsa's ops, written from the math (loops over rows or row
blocks on purpose: independent of the blocked JAX code and of the kernels).

The one copy shared by the tests (tests/ is on ``sys.path`` there, tests/conftest.py) and the
benchmark scripts (``sys.path.insert(0, "<repo>/tests"); import oracle``):

* :func:`sparse_mla`: one batch element's out, lse, max_logits and gradients (FlashMLA's
  sparse-prefill contract: invalid slots, ``topk_length``, an attention sink);
* :func:`dense_mla`: the same over every visible key (positions, segment ids);
* the lightning indexer: :func:`visible`, :func:`score_row`, :func:`topk`,
  :func:`index_scores_and_bounds` (the scores with the error bound of the tensor-core kernels),
  :func:`quantize_fp8` (DeepSeek-V3.2's FP8 rule), :func:`kl_loss` (per-row brute force);
* the KL losses with their gradients on the input dicts of the CUDA tests:
  :func:`sparse_kl_loss` (V3.2 / GLM-5), :func:`v4_kl_loss` (DeepSeek V4), and
  :func:`attention_lse`, :func:`slot_scores`, :func:`support_logits`, :func:`logsumexp`.
"""

from __future__ import annotations

import numpy as np


def rel_l2(got, want):
    """``|got - want| / |want|`` in the L2 norm, float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def logsumexp(a, axis):
    """``log sum exp`` over ``axis`` (``-inf`` where every entry is ``-inf``)."""
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m, axis)


# ---------------------------------------------------------------------------------------------
# Attention


def sparse_mla(q, kv, idx, sm_scale, d_v, sink=None, length=None, dout=None):
    """One batch element of ``sparse_mla``: ``q [S_q, H, D]``, ``kv [S_kv, D]``, ``idx [S_q, K]``
    (slots ``< 0``, ``>= S_kv`` or at/past ``length [S_q]`` are invalid), ``sink [H]``. Returns
    ``(out [S_q, H, d_v], lse [S_q, H], dq, dkv, dsink, max_logits [S_q, H])``: lse natural and
    sink-free (``+inf`` on a row without a valid slot, where out is 0), max_logits
    ``sm_scale * max q.k`` (``-inf`` there), and given ``dout`` the gradients of
    ``sum(out * dout)`` (zeros otherwise)."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    s_q, h, d = q.shape
    s_kv = kv.shape[0]
    sink = np.full(h, -np.inf) if sink is None else np.asarray(sink, np.float64)
    out = np.zeros((s_q, h, d_v))
    lse = np.full((s_q, h), np.inf)
    max_logits = np.full((s_q, h), -np.inf)
    dq, dkv, dsink = np.zeros_like(q), np.zeros_like(kv), np.zeros(h)
    for t in range(s_q):
        n = idx.shape[1] if length is None else length[t]
        rows = [int(j) for j in idx[t, :n] if 0 <= j < s_kv]
        if not rows:
            continue
        k = kv[rows]  # [n, d]
        s = sm_scale * q[t] @ k.T  # [h, n]
        m = s.max(-1)
        e = np.exp(s - m[:, None])
        lse[t] = m + np.log(e.sum(-1))
        max_logits[t] = m
        with np.errstate(over="ignore"):
            z = e.sum(-1) + np.exp(sink - m)  # the denominator over exp(m)
        p = e / z[:, None]
        out[t] = p @ k[:, :d_v]
        if dout is None:
            continue
        do = np.asarray(dout[t], np.float64)
        delta = (do * out[t]).sum(-1)
        ds = p * (do @ k[:, :d_v].T - delta[:, None])
        dq[t] = sm_scale * ds @ k
        contrib = sm_scale * ds.T @ q[t]
        contrib[:, :d_v] += p.T @ do
        for a, r in enumerate(rows):
            dkv[r] += contrib[a]
        with np.errstate(over="ignore"):
            dsink -= np.exp(sink - m) / z * delta
    return out, lse, dq, dkv, dsink, max_logits


def dense_mla(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, w, *, scale, d_v):
    """``dense_mla``: out, lse and the gradients of ``sum(out * w)`` (dq, dkv, d_sink) in
    float64, over the full [S_q, H, S_kv] matrices: the textbook softmax with a sink term in
    the denominator."""
    q, kv, w = (np.asarray(x, np.float64) for x in (q, kv, w))
    sink = np.asarray(sink, np.float64)
    vis = np.asarray(kv_pos)[..., None, :] <= np.asarray(q_pos)[..., :, None]
    if q_seg is not None:
        vis &= np.asarray(kv_seg)[..., None, :] == np.asarray(q_seg)[..., :, None]
    vis = vis[..., :, None, :]  # [..., S_q, 1, S_kv]
    s = np.einsum("...qhd,...kd->...qhk", q, kv) * scale
    s = np.where(vis, s, -np.inf)
    has = vis.any(-1)  # [..., S_q, 1]
    m = np.where(has, s.max(-1, initial=-np.inf), 0.0)
    e = np.where(vis, np.exp(s - m[..., None]), 0.0)
    z = e.sum(-1)
    lse = np.where(has, m + np.log(np.where(has, z, 1.0)), np.inf)
    denom = np.where(has, z + np.exp(sink - m), 1.0)
    p = np.where(has[..., None], e / denom[..., None], 0.0)  # sink-normalised probabilities
    v = kv[..., :d_v]
    out = np.einsum("...qhk,...kd->...qhd", p, v)
    # d sum(out * w)
    dp = np.einsum("...qhd,...kd->...qhk", w, v)
    delta = np.sum(w * out, -1)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("...qhk,...kd->...qhd", ds, kv) * scale
    dkv = np.einsum("...qhk,...qhd->...kd", ds, q) * scale
    dkv[..., :d_v] += np.einsum("...qhk,...qhd->...kd", p, w)
    p_sink = np.where(has, np.exp(sink - m) / denom, 0.0)
    d_sink = -np.sum(p_sink * delta, axis=tuple(range(delta.ndim - 1)))
    return out, lse, (dq, dkv, d_sink)


# ---------------------------------------------------------------------------------------------
# The lightning indexer


def visible(qp, kp, qs=None, ks=None):
    """``[..., S_q, S_kv]``: key ``s`` visible to query ``t`` (``kp <= qp``, same segment)."""
    qp, kp = np.asarray(qp), np.asarray(kp)
    out = np.zeros(qp.shape + (kp.shape[-1],), bool)
    for idx in np.ndindex(qp.shape):
        b = idx[:-1]
        for s in range(kp.shape[-1]):
            ok = kp[b + (s,)] <= qp[idx]
            if qs is not None:
                ok = ok and np.asarray(ks)[b + (s,)] == np.asarray(qs)[idx]
            out[idx + (s,)] = ok
    return out


def score_row(iq_t, ik_rows, iw_t):
    """iq_t [H_I, D], ik_rows [n, D], iw_t [H_I] -> [n] float64."""
    dots = np.asarray(iq_t, np.float64) @ np.asarray(ik_rows, np.float64).T
    return (np.maximum(dots, 0) * np.asarray(iw_t, np.float64)[:, None]).sum(0)


def topk(q, k, w, topk, qp, kp, qs=None, ks=None):
    """``indexer_topk``: descending score, ties to the lower key, ``-1`` padded."""
    q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
    vis = visible(qp, kp, qs, ks)
    s_kv = k.shape[-2]
    out = -np.ones(q.shape[:-2] + (topk,), np.int64)
    for idx in np.ndindex(q.shape[:-2]):
        score = score_row(q[idx], k[idx[:-1]], w[idx])
        cand = [s for s in range(s_kv) if vis[idx + (s,)]]
        cand.sort(key=lambda s: (-score[s], s))
        cand = cand[:topk]
        out[idx][: len(cand)] = cand
    return out


# The bound of one index score computed by the SM90 kernels from bf16 q, k: the tensor cores'
# float32 accumulation over D = 128 products (each exact for bf16 inputs), taken as 128 * 2^-22
# relative to sum |q k| to allow for their truncating alignment, plus the float32 weighting and
# the sum over <= 64 heads (64 * 2^-23).
SCORE_TOL = 4e-5


def index_scores_and_bounds(q, k, w, rows=None, f32_inputs=False):
    """One batch element's index scores ``I = sum_h w relu(q_h . k)`` in float64 for the query
    rows ``rows`` (all by default), ``[R, S_kv]``, and each score's error bound
    ``SCORE_TOL * sum_h |w_h| sum_d |q_hd k_d|`` (plus ``2^-8`` of that sum for float32 q, k,
    which the kernels round to bf16). ``q [S_q, H, D]``, ``k [S_kv, D]``, ``w [S_q, H]``."""
    rows = np.arange(q.shape[0]) if rows is None else np.asarray(rows)
    qq = np.asarray(q, np.float64)[rows]  # [R, H, D]
    kk = np.asarray(k, np.float64)
    ww = np.asarray(w, np.float64)[rows]
    out = np.empty((len(rows), kk.shape[0]))
    bound = np.empty_like(out)
    step = max(1, int(2e8 // (qq.shape[1] * kk.shape[0] * 8)))
    for i in range(0, len(rows), step):
        dots = np.einsum("rhd,sd->rhs", qq[i:i + step], kk, optimize=True)
        out[i:i + step] = np.einsum("rhs,rh->rs", np.maximum(dots, 0), ww[i:i + step])
        a = np.einsum("rh,rhd->rd", np.abs(ww[i:i + step]), np.abs(qq[i:i + step]))
        bound[i:i + step] = a @ np.abs(kk).T
    c = SCORE_TOL + (2.0 ** -8 if f32_inputs else 0.0)
    return out, bound * c + 1e-30


def quantize_fp8(x):
    """The UE8M0 rule in float64 NumPy: the smallest power-of-two scale with amax <= 448 scale
    (amax floored at 1e-4), then round to nearest even e4m3 (ml_dtypes)."""
    import ml_dtypes

    x = np.asarray(x, np.float64)
    amax = np.maximum(np.abs(x).max(-1), 1e-4)
    m, e = np.frexp(amax / 448.0)  # amax / 448 = m 2^e, m in [0.5, 1)
    scale = np.ldexp(1.0, np.where(m == 0.5, e - 1, e))
    x8 = (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return x8.astype(np.float64), scale


def logsoftmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl_loss(iq, ik, iw, q, kv, sm_scale, qp, kp, qs=None, ks=None, indices=None):
    """``indexer_kl_loss`` row by row: the mean over rows with a support of
    ``KL(head mean of the attention probabilities || softmax(index scores))``."""
    iq, ik, iw, q, kv = (np.asarray(x, np.float64) for x in (iq, ik, iw, q, kv))
    vis = visible(qp, kp, qs, ks)
    s_kv = kv.shape[-2]
    total, count = 0.0, 0
    for idx in np.ndindex(q.shape[:-2]):
        b = idx[:-1]
        if indices is None:
            slots = [s for s in range(s_kv) if vis[idx + (s,)]]
        else:
            slots = [int(s) for s in np.asarray(indices)[idx] if 0 <= s < s_kv and vis[idx + (s,)]]
        if not slots:
            continue
        logits = sm_scale * q[idx] @ kv[b][slots].T  # [H, n]
        p = np.exp(logsoftmax(logits)).sum(0)
        p = p / p.sum()
        log_pi = logsoftmax(score_row(iq[idx], ik[b][slots], iw[idx]))
        nz = p > 0
        total += float(np.sum(p[nz] * (np.log(p[nz]) - log_pi[nz])))
        count += 1
    return total / count if count else 0.0


# ---------------------------------------------------------------------------------------------
# The KL losses with gradients, on the input dicts of the CUDA tests: ``iq [NB, S_q, H_I, 128]``,
# ``ik [NB, S_kv, 128]``, ``iw [NB, S_q, H_I]``, ``q [NB, S_q, H, D]``, ``kv [NB, S_kv, D]``,
# positions, segment ids (or None), ``idx [NB, S_q, K]`` (every key for the dense form), and for
# V4 ``lse [NB, S_q, H]``.


def _bmm(a, b):
    """``a [n, i, j] @ b [n or 1, j, k]``, one BLAS product per entry (numpy's stacked matmul
    can be many times slower)."""
    if b.shape[0] == 1:
        return (a.reshape(-1, a.shape[-1]) @ b[0]).reshape(a.shape[:-1] + b.shape[-1:])
    return np.stack([x @ y for x, y in zip(a, b)])


def _every_key(safe, s_kv):
    """Whether every row of the slots ``safe [n, K]`` lists the keys ``0 .. S_kv - 1`` in order
    (the dense form)."""
    return safe.shape[-1] == s_kv and np.array_equal(
        safe, np.broadcast_to(np.arange(s_kv), safe.shape))


def _rows(a, b, safe):
    """``a[b][safe]`` (``[n, K, ...]``), without the gather in the dense form: then
    ``a[b][None]``, broadcast by the products."""
    return a[b][None] if _every_key(safe, a.shape[1]) else a[b][safe]


def _support(x, b, t0, t1):
    """The support ``[n, K]`` (valid, visible slots) of rows t0..t1 and the clipped slots."""
    ib = x["idx"][b, t0:t1]
    s_kv = x["kv"].shape[1]
    valid = (ib >= 0) & (ib < s_kv)
    safe = np.where(valid, ib, 0)
    sup = valid & (x["kv_pos"][b][safe] <= x["q_pos"][b, t0:t1, None])
    if x["q_seg"] is not None:
        sup &= x["kv_seg"][b][safe] == x["q_seg"][b, t0:t1, None]
    return sup, safe


def support_logits(x, b, t0, t1, sm_scale):
    """Support [n, K], the clipped slots and float64 attention logits [n, H, K] (-inf off the
    support) of rows t0..t1 of batch element b."""
    q, kv = np.asarray(x["q"], np.float64), np.asarray(x["kv"], np.float64)
    sup, safe = _support(x, b, t0, t1)
    logits = _bmm(q[b, t0:t1], np.swapaxes(_rows(kv, b, safe), -1, -2)) * sm_scale
    return sup, safe, np.where(sup[:, None], logits, -np.inf)


def _index_grads(x, b, t0, t1, sup, safe, p, out):
    """The index scores of rows t0..t1 (-inf off the support), then the gradients of the KL
    against target ``p [n, K]`` added into ``out = (d_iq, d_ik, d_w)`` (unnormalised: times
    the row count later). Returns ``(score, log_pi)``."""
    iq, ik, iw = (np.asarray(x[n], np.float64) for n in ("iq", "ik", "iw"))
    d_iq, d_ik, d_w = out
    krows = _rows(ik, b, safe)  # [n, k, 128] or [1, S_kv, 128]
    dots = _bmm(iq[b, t0:t1], np.swapaxes(krows, -1, -2))  # [n, h_i, k]
    score = np.sum(np.maximum(dots, 0) * iw[b, t0:t1, :, None], axis=1)
    score = np.where(sup, score, -np.inf)
    log_pi = np.where(sup, score - logsumexp(score, -1)[:, None], 0)
    pi = np.where(sup, np.exp(log_pi), 0)
    ds = np.where(sup, pi * p.sum(-1, keepdims=True) - p, 0)  # times g = 1 / count
    d_w[b, t0:t1] = np.einsum("nk,nhk->nh", ds, np.maximum(dots, 0), optimize=True)
    gmat = ds[:, None, :] * iw[b, t0:t1, :, None] * (dots > 0)
    d_iq[b, t0:t1] = _bmm(gmat, krows)
    u = np.stack([g.T @ a for g, a in zip(gmat, iq[b, t0:t1])])  # [n, k, 128]
    if _every_key(safe, ik.shape[1]):  # d_ik[b][s] gathers column s of every row
        d_ik[b] += np.where(sup[..., None], u, 0).sum(0)
    else:
        np.add.at(d_ik[b], safe[sup], u[sup])
    return score, log_pi


@np.errstate(invalid="ignore")
def sparse_kl_loss(x, sm_scale, block=16):
    """float64 loss and gradients ``(loss, d_iq, d_ik, d_w)`` of ``indexer_kl_loss`` (V3.2 /
    GLM-5: the target is the head mean of the attention's softmax over each row's support)
    on the given (bf16-rounded) inputs."""
    iq, ik, iw = (np.asarray(x[n], np.float64) for n in ("iq", "ik", "iw"))
    nb, s_q = iq.shape[:2]
    grads = (np.zeros_like(iq), np.zeros_like(ik), np.zeros_like(iw))
    kl_total, count = 0.0, 0
    for b in range(nb):
        for t0 in range(0, s_q, block):
            t1 = min(s_q, t0 + block)
            sup, safe, logits = support_logits(x, b, t0, t1, sm_scale)
            m = logits.max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            e = np.exp(logits - m)
            z = e.sum(-1, keepdims=True)
            p = (e / np.where(z > 0, z, 1)).mean(1)  # [n, k]
            _, log_pi = _index_grads(x, b, t0, t1, sup, safe, p, grads)
            pos = sup & (p > 0)
            kl = np.where(pos, p * (np.log(np.where(pos, p, 1)) - log_pi), 0).sum(-1)
            has = sup.any(-1)
            kl_total += kl[has].sum()
            count += int(has.sum())
    if count == 0:
        return (0.0,) + grads
    return (kl_total / count,) + tuple(g / count for g in grads)


@np.errstate(invalid="ignore")
def v4_kl_loss(x, sm_scale, block=16):
    """float64 loss and gradients ``(loss, d_iq, d_ik, d_w)`` of DeepSeek V4's KL loss (the
    target's per-head denominators are ``x["lse"]``: window, compressed entries and sink; see
    jax_dsa.ops.indexer.v4_kl_loss), in log space, on the given inputs."""
    iq, ik, iw, lse = (np.asarray(x[n], np.float64) for n in ("iq", "ik", "iw", "lse"))
    nb, s_q = iq.shape[:2]
    grads = (np.zeros_like(iq), np.zeros_like(ik), np.zeros_like(iw))
    kl_total, count = 0.0, 0
    for b in range(nb):
        for t0 in range(0, s_q, block):
            t1 = min(s_q, t0 + block)
            sup, safe, logits = support_logits(x, b, t0, t1, sm_scale)
            log_t = logsumexp(logits - lse[b, t0:t1, :, None], 1)  # [n, K]
            log_t = np.where(sup, log_t, -np.inf)
            log_p = log_t - logsumexp(log_t, -1)[:, None]
            p = np.where(sup, np.exp(log_p), 0)
            _, log_pi = _index_grads(x, b, t0, t1, sup, safe, p, grads)
            pos = sup & (p > 0)
            kl = np.where(pos, p * (np.where(pos, log_p, 0) - log_pi), 0).sum(-1)
            has = sup.any(-1)
            kl_total += kl[has].sum()
            count += int(has.sum())
    if count == 0:
        return (0.0,) + grads
    return (kl_total / count,) + tuple(g / count for g in grads)


def attention_lse(x, sm_scale):
    """float64 natural-log softmax denominators ``[nb, s_q, h]`` of the main attention over each
    row's support (+inf for rows without one): what sparse_mla returns for these slots."""
    nb, s_q, h = np.shape(x["q"])[:3]
    out = np.full((nb, s_q, h), np.inf)
    for b in range(nb):
        for t0 in range(0, s_q, 64):
            t1 = min(s_q, t0 + 64)
            _, _, logits = support_logits(x, b, t0, t1, sm_scale)
            lse = logsumexp(logits, -1)
            out[b, t0:t1] = np.where(np.isfinite(lse), lse, np.inf)
    return out.astype(np.float32)


def slot_scores(x):
    """float64 index scores of each slot (garbage on invalid slots: the support drops them)."""
    iq, ik, iw = (np.asarray(x[n], np.float64) for n in ("iq", "ik", "iw"))
    safe = np.clip(x["idx"], 0, ik.shape[1] - 1)
    rows = np.stack([ik[b][safe[b]] for b in range(ik.shape[0])])  # [nb, s_q, k, 128]
    dots = np.einsum("bshd,bskd->bshk", iq, rows)
    return np.einsum("bshk,bsh->bsk", np.maximum(dots, 0), iw).astype(np.float32)
