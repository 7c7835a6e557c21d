"""Tests of jax_dsa.ops.indexer against float64 NumPy brute force and finite differences."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk, visible_mask


@pytest.fixture
def x64():
    # Scoped to the test: other test files keep float32 defaults.
    with jax.enable_x64(True):
        yield


# ------------------------------------------------------------------------------------------
# NumPy float64 oracles (loops over rows on purpose: independent of the blocked JAX code)


def np_visible(qp, kp, qs=None, ks=None):
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


def np_score_row(iq_t, ik_rows, iw_t):
    """iq_t [H_I, D], ik_rows [n, D], iw_t [H_I] -> [n] float64."""
    dots = np.asarray(iq_t, np.float64) @ np.asarray(ik_rows, np.float64).T
    return (np.maximum(dots, 0) * np.asarray(iw_t, np.float64)[:, None]).sum(0)


def np_topk(q, k, w, topk, qp, kp, qs=None, ks=None):
    q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
    vis = np_visible(qp, kp, qs, ks)
    s_kv = k.shape[-2]
    out = -np.ones(q.shape[:-2] + (topk,), np.int64)
    for idx in np.ndindex(q.shape[:-2]):
        score = np_score_row(q[idx], k[idx[:-1]], w[idx])
        cand = [s for s in range(s_kv) if vis[idx + (s,)]]
        cand.sort(key=lambda s: (-score[s], s))
        cand = cand[:topk]
        out[idx][: len(cand)] = cand
    return out


def np_logsoftmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kl_loss(iq, ik, iw, q, kv, sm_scale, qp, kp, qs=None, ks=None, indices=None):
    iq, ik, iw, q, kv = (np.asarray(x, np.float64) for x in (iq, ik, iw, q, kv))
    vis = np_visible(qp, kp, qs, ks)
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
        p = np.exp(np_logsoftmax(logits)).sum(0)
        p = p / p.sum()
        log_pi = np_logsoftmax(np_score_row(iq[idx], ik[b][slots], iw[idx]))
        nz = p > 0
        total += float(np.sum(p[nz] * (np.log(p[nz]) - log_pi[nz])))
        count += 1
    return total / count if count else 0.0


def _max_intermediate(jaxpr):
    """Largest number of elements of any value produced in a jaxpr, sub-jaxprs included."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            best = max(best, math.prod(getattr(v.aval, "shape", ())))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    best = max(best, _max_intermediate(inner))
    return best


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------------------------------
# visible_mask


def test_visible_mask_matches_brute_force():
    rng = np.random.default_rng(0)
    qp = rng.integers(0, 12, (2, 3, 5))
    kp = rng.integers(0, 12, (2, 3, 7))
    qs = rng.integers(0, 2, (2, 3, 5))
    ks = rng.integers(0, 2, (2, 3, 7))
    got = visible_mask(qp, kp)
    assert got.shape == (2, 3, 5, 7) and got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, np_visible(qp, kp))
    got = visible_mask(qp, kp, qs, ks)
    np.testing.assert_array_equal(got, np_visible(qp, kp, qs, ks))
    # Both kinds of exclusion occur, so the test can tell them apart.
    assert np_visible(qp, kp).sum() > np_visible(qp, kp, qs, ks).sum() > 0


# ------------------------------------------------------------------------------------------
# indexer_topk


def test_lax_top_k_is_stable_on_ties():
    # The tie rule of indexer_topk relies on this: equal values come out lower index first.
    x = jnp.array([[0.0, 2.0, 0.0, 2.0, -1.0, 0.0, 2.0, 0.0]])
    vals, idx = jax.lax.top_k(x, 8)
    np.testing.assert_array_equal(idx[0], [1, 3, 6, 0, 2, 5, 7, 4])
    np.testing.assert_array_equal(vals[0], [2, 2, 2, 0, 0, 0, 0, -1])


def test_topk_random_batch_dims_and_offsets():
    rng = np.random.default_rng(1)
    batch, s_q, s_kv, h_i, d_i = (2, 3), 9, 13, 3, 4
    q = _rand(rng, batch + (s_q, h_i, d_i))
    k = _rand(rng, batch + (s_kv, d_i))
    w = _rand(rng, batch + (s_q, h_i))
    # Queries are the last S_q tokens of the key range, plus a per-batch offset.
    off = rng.integers(0, 50, batch)
    kp = off[..., None] + np.arange(s_kv)
    qp = off[..., None] + np.arange(s_kv - s_q, s_kv)
    topk = 6
    want = np_topk(q, k, w, topk, qp, kp)
    got = indexer_topk(q, k, w, topk=topk, q_positions=qp, kv_positions=kp, block_q=4)
    assert got.shape == batch + (s_q, topk) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    # Early rows see fewer than topk keys: -1 padding is exercised.
    assert (want == -1).any() and (want[..., -1, :] >= 0).all()
    # The default block size gives the same answer.
    np.testing.assert_array_equal(
        indexer_topk(q, k, w, topk=topk, q_positions=qp, kv_positions=kp), want
    )


def test_topk_exact_ties_go_to_lower_index():
    rng = np.random.default_rng(2)
    s, h_i, d_i = 12, 2, 3
    # Small integers: every score is exact in float32 and ReLU makes many exact zeros.
    q = rng.integers(-1, 2, (s, h_i, d_i)).astype(np.float32)
    k = rng.integers(-1, 2, (s, d_i)).astype(np.float32)
    k[7] = k[2]
    k[9] = k[2]
    k[10] = k[4]
    w = np.array([[1.0, -1.0]] * s, np.float32)
    w[::3] = [2.0, 1.0]
    w[1::4] = [-1.0, -2.0]  # all-negative rows: their zero plateau is -0.0
    pos = np.arange(s)
    want = np_topk(q, k, w, s, pos, pos)
    got = indexer_topk(q, k, w, topk=s, q_positions=pos, kv_positions=pos, block_q=4)
    np.testing.assert_array_equal(got, want)
    scores = np.stack([np_score_row(q[t], k, w[t]) for t in range(s)])
    # Plenty of ties among visible keys, so the tie rule is really being tested.
    n_ties = sum(
        len(row[: t + 1]) - len(np.unique(row[: t + 1])) for t, row in enumerate(scores)
    )
    assert n_ties > 10


def test_topk_never_picks_invisible_keys_even_when_visible_scores_are_zero():
    s, d_i = 6, 2
    q = np.ones((s, 1, d_i), np.float32)
    k = np.full((s, d_i), -1.0, np.float32)  # visible keys: relu(-2) = 0
    k[3:] = 5.0  # future keys score far higher
    w = np.ones((s, 1), np.float32)
    qp = np.full((s,), 2)
    kp = np.arange(s)
    got = indexer_topk(q, k, w, topk=5, q_positions=qp, kv_positions=kp, block_q=2)
    np.testing.assert_array_equal(got, np.tile([0, 1, 2, -1, -1], (s, 1)))


def test_topk_packed_documents():
    rng = np.random.default_rng(3)
    seg = np.array([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3])
    pos = np.concatenate([np.arange(n) for n in np.bincount(seg)])
    s = seg.size
    q, k, w = _rand(rng, (s, 2, 4)), _rand(rng, (s, 4)), np.abs(_rand(rng, (s, 2)))
    topk = 4
    got = np.asarray(
        indexer_topk(
            q, k, w, topk=topk, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
            kv_segment_ids=seg, block_q=4,
        )
    )
    np.testing.assert_array_equal(got, np_topk(q, k, w, topk, pos, pos, seg, seg))
    for t in range(s):
        picks = got[t][got[t] >= 0]
        assert (seg[picks] == seg[t]).all() and (picks <= t).all()
        assert len(picks) == min(topk, pos[t] + 1)
    # Without segment ids, per-document positions alone would leak across documents.
    leaky = indexer_topk(q, k, w, topk=topk, q_positions=pos, kv_positions=pos, block_q=4)
    assert (np.asarray(leaky) != got).any()


def test_topk_larger_than_s_kv():
    rng = np.random.default_rng(4)
    s_q, s_kv = 5, 6
    q, k, w = _rand(rng, (s_q, 2, 3)), _rand(rng, (s_kv, 3)), _rand(rng, (s_q, 2))
    qp = np.arange(1, s_q + 1)
    kp = np.arange(s_kv)
    got = indexer_topk(q, k, w, topk=15, q_positions=qp, kv_positions=kp, block_q=2)
    assert got.shape == (s_q, 15)
    want = np_topk(q, k, w, 15, qp, kp)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal((np.asarray(got) >= 0).sum(-1), qp + 1)


def test_topk_under_jit_and_vmap():
    rng = np.random.default_rng(5)
    nb, s_q, s_kv = 3, 7, 9
    q, k, w = _rand(rng, (nb, s_q, 2, 3)), _rand(rng, (nb, s_kv, 3)), _rand(rng, (nb, s_q, 2))
    kp = np.broadcast_to(np.arange(s_kv), (nb, s_kv))
    qp = np.broadcast_to(np.arange(2, 2 + s_q), (nb, s_q))
    want = np_topk(q, k, w, 4, qp, kp)
    f = jax.jit(functools.partial(indexer_topk, topk=4, block_q=2))
    np.testing.assert_array_equal(f(q, k, w, q_positions=qp, kv_positions=kp), want)
    g = jax.vmap(lambda a, b, c, d, e: f(a, b, c, q_positions=d, kv_positions=e))
    np.testing.assert_array_equal(g(q, k, w, qp, kp), want)


def test_topk_memory_is_blocked():
    s, h_i, d_i = 64, 2, 4
    args = (jnp.zeros((s, h_i, d_i)), jnp.zeros((s, d_i)), jnp.zeros((s, h_i)))
    pos = jnp.arange(s)
    jaxpr = jax.make_jaxpr(
        lambda q, k, w: indexer_topk(q, k, w, topk=8, q_positions=pos, kv_positions=pos, block_q=8)
    )(*args)
    biggest = _max_intermediate(jaxpr.jaxpr)
    assert biggest == 8 * h_i * s  # one block's [block_q, H_I, S_kv] scores
    assert biggest < s * s


# ------------------------------------------------------------------------------------------
# indexer_kl_loss


def _loss_inputs(rng, batch, s_q, s_kv, h_i=2, d_i=3, h=3, d_qk=5, dtype=np.float32):
    return (
        _rand(rng, batch + (s_q, h_i, d_i), dtype),
        _rand(rng, batch + (s_kv, d_i), dtype),
        _rand(rng, batch + (s_q, h_i), dtype),
        _rand(rng, batch + (s_q, h, d_qk), dtype),
        _rand(rng, batch + (s_kv, d_qk), dtype),
    )


def test_kl_dense_matches_brute_force():
    rng = np.random.default_rng(10)
    batch, s_q, s_kv = (2,), 7, 10
    ins = _loss_inputs(rng, batch, s_q, s_kv)
    kp = np.broadcast_to(np.arange(s_kv), batch + (s_kv,))
    qp = np.broadcast_to(np.arange(s_kv - s_q, s_kv), batch + (s_q,))
    want = np_kl_loss(*ins, 0.7, qp, kp)
    got = indexer_kl_loss(*ins, sm_scale=0.7, q_positions=qp, kv_positions=kp, block_q=3)
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert want > 0.05  # a real distance, not a trivially small one
    got = indexer_kl_loss(*ins, sm_scale=0.7, q_positions=qp, kv_positions=kp)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_kl_sparse_with_invalid_and_duplicate_slots():
    rng = np.random.default_rng(11)
    batch, s_q, s_kv = (2,), 6, 8
    ins = _loss_inputs(rng, batch, s_q, s_kv)
    kp = np.broadcast_to(np.arange(s_kv), batch + (s_kv,))
    qp = np.broadcast_to(np.arange(2, 2 + s_q), batch + (s_q,))
    indices = np.array(
        [
            [0, 1, 2, -1, 1],  # duplicate slot
            [3, 3, 3, 0, -1],  # triple duplicate
            [-1, -1, -1, -1, -1],  # empty row
            [8, 2, -7, 4, 11],  # out-of-range slots
            [7, 5, 1, 0, 6],  # 6 and 7 are in the future: not in the support
            [5, 4, 3, 2, 1],
        ]
    )
    indices = np.stack([indices, np.roll(indices, 1, axis=0)])
    want = np_kl_loss(*ins, 0.4, qp, kp, indices=indices)
    got = indexer_kl_loss(
        *ins, sm_scale=0.4, q_positions=qp, kv_positions=kp, indices=indices, block_q=4
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # Duplicates really count as separate slots: dropping one changes the loss.
    dedup = indices.copy()
    dedup[0, 1, 1:3] = -1
    assert abs(np_kl_loss(*ins, 0.4, qp, kp, indices=dedup) - want) > 1e-3


def test_kl_sparse_on_indexer_topk_output():
    rng = np.random.default_rng(12)
    s = 9
    ins = _loss_inputs(rng, (), s, s)
    pos = np.arange(s)
    idx = indexer_topk(*ins[:3], topk=4, q_positions=pos, kv_positions=pos, block_q=4)
    want = np_kl_loss(*ins, 0.5, pos, pos, indices=np.asarray(idx))
    got = indexer_kl_loss(*ins, sm_scale=0.5, q_positions=pos, kv_positions=pos, indices=idx)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_kl_packed_segments_and_empty_rows():
    rng = np.random.default_rng(13)
    q_seg = np.array([0, 0, 1, 1, 1, 5, 2, 2])  # document 5 has no keys: an empty row
    kv_seg = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    kp = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    qp = np.array([1, 2, 0, 1, 2, 2, 0, 1])
    ins = _loss_inputs(rng, (), q_seg.size, kv_seg.size)
    kw = dict(q_positions=qp, kv_positions=kp, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    want = np_kl_loss(*ins, 0.6, qp, kp, q_seg, kv_seg)
    got = indexer_kl_loss(*ins, sm_scale=0.6, block_q=2, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # The empty row does not count in the mean: it differs from a mean over all 8 rows.
    assert abs(want * 7 / 8 - want) > 1e-3
    idx = np.tile(np.arange(9), (8, 1))
    want = np_kl_loss(*ins, 0.6, qp, kp, q_seg, kv_seg, indices=idx)
    got = indexer_kl_loss(*ins, sm_scale=0.6, block_q=2, indices=idx, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_kl_without_any_support_is_zero_with_zero_grads():
    rng = np.random.default_rng(14)
    ins = _loss_inputs(rng, (), 4, 5)
    qp, kp = np.zeros(4, int), np.arange(1, 6)  # every key is in the future
    f = lambda a, b, c: indexer_kl_loss(
        a, b, c, *ins[3:], sm_scale=1.0, q_positions=qp, kv_positions=kp
    )
    assert float(f(*ins[:3])) == 0.0
    for g in jax.grad(f, argnums=(0, 1, 2))(*ins[:3]):
        np.testing.assert_array_equal(g, 0)
    idx = -np.ones((4, 3), int)
    loss = indexer_kl_loss(*ins, sm_scale=1.0, q_positions=np.arange(4), kv_positions=kp,
                           indices=idx)
    assert float(loss) == 0.0


def test_kl_gradients_match_finite_differences(x64):
    rng = np.random.default_rng(15)
    batch, s_q, s_kv = (2,), 5, 7
    ins = [jnp.asarray(x) for x in _loss_inputs(rng, batch, s_q, s_kv, dtype=np.float64)]
    assert ins[0].dtype == jnp.float64
    kp = np.broadcast_to(np.arange(s_kv), batch + (s_kv,))
    qp = np.broadcast_to(np.arange(2, 2 + s_q), batch + (s_q,))
    idx = rng.integers(-2, s_kv + 1, batch + (s_q, 4))

    for indices in (None, idx):
        @jax.jit
        def f(a, b, c, indices=indices):
            return indexer_kl_loss(
                a, b, c, ins[3], ins[4], sm_scale=0.5, q_positions=qp, kv_positions=kp,
                indices=indices, block_q=2,
            )

        val = f(*ins[:3])
        assert val.dtype == jnp.float64
        np.testing.assert_allclose(val, np_kl_loss(*ins, 0.5, qp, kp, indices=indices),
                                   rtol=1e-10)
        check_grads(f, tuple(ins[:3]), order=1, modes=("rev",), eps=1e-5)
        grads = jax.grad(f, argnums=(0, 1, 2))(*ins[:3])
        assert all(float(jnp.abs(g).max()) > 1e-4 for g in grads)


def test_kl_gradient_wrt_q_and_kv_is_zero():
    rng = np.random.default_rng(16)
    ins = _loss_inputs(rng, (), 6, 6)
    pos = np.arange(6)
    for indices in (None, np.tile([0, 2, 4, -1], (6, 1))):
        f = lambda q, kv: indexer_kl_loss(
            *ins[:3], q, kv, sm_scale=0.5, q_positions=pos, kv_positions=pos, indices=indices
        )
        dq, dkv = jax.grad(f, argnums=(0, 1))(*ins[3:])
        np.testing.assert_array_equal(dq, 0)
        np.testing.assert_array_equal(dkv, 0)
        assert float(f(*ins[3:])) > 0


def test_kl_bfloat16_inputs():
    rng = np.random.default_rng(17)
    s = 8
    ins = [jnp.asarray(x, jnp.bfloat16) for x in _loss_inputs(rng, (), s, s)]
    pos = np.arange(s)
    got = indexer_kl_loss(*ins, sm_scale=0.5, q_positions=pos, kv_positions=pos, block_q=4)
    assert got.dtype == jnp.float32
    # The oracle sees the same bf16-rounded values in float64.
    want = np_kl_loss(*(np.asarray(x, np.float64) for x in ins), 0.5, pos, pos)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    grads = jax.grad(
        lambda a, b, c: indexer_kl_loss(
            a, b, c, *ins[3:], sm_scale=0.5, q_positions=pos, kv_positions=pos, block_q=4
        ),
        argnums=(0, 1, 2),
    )(*ins[:3])
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.isfinite(g).all()) for g in grads)


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16))


# Each bf16-input gradient may be off the float64 one by at most this many times the error of
# rounding the float64 gradient to bf16 once. Accumulating in float32 and rounding once gives
# 1.00x; accumulating index_k's gradient in bf16 gave 5.8x-7x (sparse) and 1.5x (dense, whose
# per-block gradient is one einsum but the sum over query blocks ran in bf16).
BF16_GRAD_FACTOR = 1.25


def check_bf16_grads_against_float64(loss, index_args, other_args):
    """``jax.grad(loss)`` in the index tensors on bf16 inputs against the same loss on the same
    bf16-rounded values in float64: each gradient's relative L2 error is at most
    ``BF16_GRAD_FACTOR`` times the floor (the float64 gradient rounded to bf16 once)."""
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    got = grad(*(jnp.asarray(x, jnp.bfloat16) for x in index_args + other_args))
    assert all(g.dtype == jnp.bfloat16 for g in got)
    with jax.enable_x64(True):
        want = grad(*(jnp.asarray(x, jnp.float64) for x in index_args + other_args))
        want = [np.asarray(g) for g in want]
    for name, g, w in zip(("index_q", "index_k", "index_weights"), got, want):
        floor = _rel_l2(_bf16(w), w)
        assert 5e-4 < floor < 4e-3, (name, floor)  # bf16's rounding error, not a tiny gradient
        err = _rel_l2(g, w)
        assert err <= BF16_GRAD_FACTOR * floor, (name, err, floor)


@pytest.mark.parametrize("sparse", [True, False])
def test_kl_bfloat16_gradients_accumulate_in_float32(sparse):
    """GLM-5-like dims scaled down (index heads 32 x 128, H 16, D_qk 576, top-k 256, S 512).
    index_k's gradient sums over every query block and, sparse, over every slot that selects a
    key: it must accumulate in float32 and round to bf16 once, not round at every add."""
    rng = np.random.default_rng(20)
    s, h_i, d_i, h, d_qk, topk = 512, 32, 128, 16, 576, 256
    iq = _bf16(rng.standard_normal((s, h_i, d_i)))
    ik = _bf16(rng.standard_normal((s, d_i)))
    iw = _bf16(rng.standard_normal((s, h_i)) * (h_i * d_i) ** -0.5)  # the reference's scale
    q = _bf16(rng.standard_normal((s, h, d_qk)))
    kv = _bf16(rng.standard_normal((s, d_qk)))
    pos = np.arange(s, dtype=np.int32)
    idx = None
    if sparse:
        idx = np.asarray(indexer_topk(iq, ik, iw, topk=topk, q_positions=pos, kv_positions=pos))

    def loss(iq, ik, iw, q, kv):
        return indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=d_qk**-0.5, q_positions=pos,
                               kv_positions=pos, indices=idx)

    check_bf16_grads_against_float64(loss, (iq, ik, iw), (q, kv))


def test_kl_under_jit_and_vmap():
    rng = np.random.default_rng(18)
    nb, s = 3, 6
    ins = _loss_inputs(rng, (nb,), s, s)
    pos = np.broadcast_to(np.arange(s), (nb, s))
    f = jax.jit(functools.partial(indexer_kl_loss, sm_scale=0.5, block_q=4))
    per = jax.vmap(lambda *a: f(*a[:5], q_positions=a[5], kv_positions=a[6]))(*ins, pos, pos)
    want = [np_kl_loss(*(x[b] for x in ins), 0.5, pos[b], pos[b]) for b in range(nb)]
    np.testing.assert_allclose(per, want, rtol=2e-5, atol=1e-6)
    # Every row has support here, so the batched loss is the mean of the per-element losses.
    np.testing.assert_allclose(
        f(*ins, q_positions=pos, kv_positions=pos), np.mean(want), rtol=2e-5
    )


def test_kl_backward_memory_is_blocked():
    s, h_i, d_i, h, d_qk = 64, 2, 4, 2, 4
    rng = np.random.default_rng(19)
    ins = _loss_inputs(rng, (), s, s, h_i, d_i, h, d_qk)
    pos = jnp.arange(s)
    f = lambda a, b, c: indexer_kl_loss(
        a, b, c, *ins[3:], sm_scale=0.5, q_positions=pos, kv_positions=pos, block_q=8
    )
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(*ins[:3])
    biggest = _max_intermediate(jaxpr.jaxpr)
    assert biggest <= 8 * max(h, h_i) * s  # one block's [block_q, heads, S_kv] logits
    assert biggest < s * s


def test_topk_return_scores_are_the_selected_keys_scores():
    rng = np.random.default_rng()
    b, s_q, s_kv, h, d, topk = 2, 30, 20, 3, 8, 24  # topk > S_kv: padded slots
    q, k, w = _rand(rng, (b, s_q, h, d)), _rand(rng, (b, s_kv, d)), _rand(rng, (b, s_q, h))
    qp = np.broadcast_to(np.arange(s_q) - 5, (b, s_q))
    kp = np.broadcast_to(np.arange(s_kv), (b, s_kv))
    idx, scores = indexer_topk(q, k, w, topk=topk, q_positions=qp, kv_positions=kp,
                               return_scores=True)
    np.testing.assert_array_equal(idx, indexer_topk(q, k, w, topk=topk, q_positions=qp,
                                                    kv_positions=kp))
    assert scores.shape == (b, s_q, topk) and scores.dtype == jnp.float32
    idx, scores = np.asarray(idx), np.asarray(scores)
    for i in np.ndindex(b, s_q):
        ok = idx[i] >= 0
        assert np.all(scores[i][~ok] == -np.inf)
        want = np_score_row(q[i], k[i[0]][idx[i][ok]], w[i])
        np.testing.assert_allclose(scores[i][ok], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The fp8 scores (qk_dtype="float8_e4m3fn")


def np_quantize_fp8(x):
    """The UE8M0 rule in float64 NumPy: the smallest power-of-two scale with amax <= 448 scale
    (amax floored at 1e-4), then round to nearest even e4m3 (ml_dtypes)."""
    import ml_dtypes

    x = np.asarray(x, np.float64)
    amax = np.maximum(np.abs(x).max(-1), 1e-4)
    m, e = np.frexp(amax / 448.0)  # amax / 448 = m 2^e, m in [0.5, 1)
    scale = np.ldexp(1.0, np.where(m == 0.5, e - 1, e))
    x8 = (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return x8.astype(np.float64), scale


def test_quantize_fp8_follows_the_ue8m0_rule():
    from jax_dsa.ops.indexer.scores import quantize_fp8

    rng = np.random.default_rng()
    x = rng.standard_normal((6, 40)) * np.array([1e-7, 1e-3, 1, 448, 896, 3e4])[:, None]
    x[0] = 0  # floored amax
    x[3] = rng.uniform(-400, 400, 40)
    x[3, 0] = 448  # amax exactly 448: scale 1
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    x8, scale = quantize_fp8(jnp.asarray(x, jnp.bfloat16))
    assert x8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    ref8, ref_scale = np_quantize_fp8(x)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), ref_scale)
    np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32), np.float64), ref8)
    assert ref_scale[3] == 1.0
    assert np.all(np.abs(ref8) <= 448) and np.all(np.abs(x).max(-1)[1:] > 224 * ref_scale[1:])
    np.testing.assert_allclose(ref8 * ref_scale[:, None], x, rtol=2.0 ** -4, atol=2.0 ** -9 * ref_scale[:, None].max())


def test_topk_fp8_selects_by_the_fp8_scores():
    rng = np.random.default_rng()
    b, s_q, s_kv, h, d, topk = 2, 40, 64, 4, 32, 12
    q = np.asarray(jnp.asarray(rng.standard_normal((b, s_q, h, d)), jnp.bfloat16).astype(jnp.float32))
    k = np.asarray(jnp.asarray(rng.standard_normal((b, s_kv, d)) * 3, jnp.bfloat16).astype(jnp.float32))
    w = rng.standard_normal((b, s_q, h)).astype(np.float32)
    qp = np.broadcast_to(np.arange(s_q) + 20, (b, s_q))
    kp = np.broadcast_to(np.arange(s_kv), (b, s_kv))
    qs = np.broadcast_to(np.arange(s_q) // 25, (b, s_q))
    ks = np.broadcast_to(np.arange(s_kv) // 30, (b, s_kv))
    got = np.asarray(indexer_topk(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), w, topk=topk, q_positions=qp,
        kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks, qk_dtype="float8_e4m3fn",
        implementation="xla"))
    q8, q_scale = np_quantize_fp8(q)
    k8, k_scale = np_quantize_fp8(k)
    vis = np_visible(qp, kp, qs, ks)
    for i in np.ndindex(b, s_q):
        dots = q8[i] @ k8[i[0]].T  # exact in float32 too: fp8 products and short sums
        score = (np.maximum(dots, 0) * (w[i] * q_scale[i])[:, None]).sum(0) * k_scale[i[0]]
        tol = 1e-5 * (np.abs(dots) * np.abs(w[i] * q_scale[i])[:, None]).sum(0) * k_scale[i[0]]
        v = vis[i]
        n = min(topk, int(v.sum()))
        head = got[i][:n]
        assert np.all(got[i][n:] == -1) and len(set(head.tolist())) == n and np.all(v[head])
        rest = v.copy()
        rest[head] = False
        if rest.any() and n:
            assert np.max(score[rest] - tol[rest]) <= np.min(score[head] + tol[head])
    bf16 = np.asarray(indexer_topk(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), w, topk=topk, q_positions=qp,
        kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks, implementation="xla"))
    assert np.any(bf16 != got)  # fp8 rounding moves some selections


# ------------------------------------------------------------------------------------------
# Errors


def _topk_call(**over):
    a = dict(
        q=jnp.zeros((4, 2, 3)), k=jnp.zeros((5, 3)), weights=jnp.zeros((4, 2)), topk=2,
        q_positions=jnp.arange(4), kv_positions=jnp.arange(5),
    )
    a.update(over)
    q, k, w = a.pop("q"), a.pop("k"), a.pop("weights")
    return indexer_topk(q, k, w, **a)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(q=jnp.zeros((4, 3))), ValueError, "q must"),
        (dict(k=jnp.zeros((5, 4))), ValueError, "k must"),
        (dict(weights=jnp.zeros((4, 3))), ValueError, "weights must"),
        (dict(q=jnp.zeros((4, 2, 3), jnp.int32)), TypeError, "q must be a float"),
        (dict(topk=0), ValueError, "topk must be >= 1"),
        (dict(topk=2.0), TypeError, "topk must be a Python int"),
        (dict(block_q=0), ValueError, "block_q must be >= 1"),
        (dict(q_positions=jnp.arange(5)), ValueError, "q_positions must have shape"),
        (dict(kv_positions=jnp.zeros(5)), TypeError, "kv_positions must be an integer"),
        (dict(q_segment_ids=jnp.zeros(4, jnp.int32)), ValueError, "kv_segment_ids"),
        (dict(qk_dtype=jnp.bfloat16), ValueError, "qk_dtype must be None or 'float8_e4m3fn'"),
        (dict(qk_dtype="fp8"), ValueError, "qk_dtype must be None"),
        (
            dict(q_segment_ids=jnp.zeros(4, jnp.int32), kv_segment_ids=jnp.zeros(4, jnp.int32)),
            ValueError,
            "kv_segment_ids must have shape",
        ),
    ],
)
def test_topk_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _topk_call(**over)


def _loss_call(**over):
    a = dict(
        index_q=jnp.zeros((4, 2, 3)), index_k=jnp.zeros((5, 3)), index_weights=jnp.zeros((4, 2)),
        q=jnp.zeros((4, 3, 6)), kv=jnp.zeros((5, 6)), sm_scale=0.5,
        q_positions=jnp.arange(4), kv_positions=jnp.arange(5),
    )
    a.update(over)
    pos = [a.pop(n) for n in ("index_q", "index_k", "index_weights", "q", "kv")]
    return indexer_kl_loss(*pos, **a)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(sm_scale=None), TypeError, "sm_scale"),
        (dict(index_q=jnp.zeros((4, 2))), ValueError, "index_q must"),
        (dict(index_k=jnp.zeros((6, 2))), ValueError, "index_k must"),
        (dict(index_weights=jnp.zeros((4, 3))), ValueError, "index_weights must"),
        (dict(q=jnp.zeros((3, 3, 6))), ValueError, "q must"),
        (dict(kv=jnp.zeros((5, 7))), ValueError, "kv must"),
        (dict(kv=jnp.zeros((5, 6), jnp.bfloat16)), TypeError, "q and kv"),
        (dict(indices=jnp.zeros((4, 2))), TypeError, "indices must be an integer"),
        (dict(indices=jnp.zeros((3, 2), jnp.int32)), ValueError, "indices must be"),
        (dict(kv_positions=jnp.arange(4)), ValueError, "kv_positions must have shape"),
        (dict(block_q=-1), ValueError, "block_q"),
    ],
)
def test_kl_loss_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _loss_call(**over)


def test_visible_mask_bad_input():
    with pytest.raises(ValueError, match="kv_positions"):
        visible_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(TypeError, match="q_positions"):
        visible_mask(jnp.zeros(3), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        visible_mask(jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("sm_scale", [0.0, -0.5, float("nan"), float("inf")])
def test_kl_loss_refuses_a_scale_that_is_not_finite_and_positive(sm_scale):
    s, d = 8, 16
    x = np.ones((s, 2, d), np.float32)
    with pytest.raises(ValueError, match="sm_scale"):
        indexer_kl_loss(x, np.ones((s, d), np.float32), np.ones((s, 2), np.float32), x,
                        np.ones((s, d), np.float32), sm_scale=sm_scale, q_positions=np.arange(s),
                        kv_positions=np.arange(s))
