"""indexer_topk and visible_mask (jax_dsa.ops.indexer.topk, jax_dsa.ops.visibility; the "xla"
implementation) against float64 NumPy brute force (tests/oracle.py): batch dims, ties, packed
documents, blocked memory, the selected keys' scores, the FP8 scores, argument errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from jax_dsa.ops.indexer import indexer_topk, visible_mask


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
    np.testing.assert_array_equal(got, oracle.visible(qp, kp))
    got = visible_mask(qp, kp, qs, ks)
    np.testing.assert_array_equal(got, oracle.visible(qp, kp, qs, ks))
    # Both kinds of exclusion occur, so the test can tell them apart.
    assert oracle.visible(qp, kp).sum() > oracle.visible(qp, kp, qs, ks).sum() > 0


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
    want = oracle.topk(q, k, w, topk, qp, kp)
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
    want = oracle.topk(q, k, w, s, pos, pos)
    got = indexer_topk(q, k, w, topk=s, q_positions=pos, kv_positions=pos, block_q=4)
    np.testing.assert_array_equal(got, want)
    scores = np.stack([oracle.score_row(q[t], k, w[t]) for t in range(s)])
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
    np.testing.assert_array_equal(got, oracle.topk(q, k, w, topk, pos, pos, seg, seg))
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
    want = oracle.topk(q, k, w, 15, qp, kp)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal((np.asarray(got) >= 0).sum(-1), qp + 1)


def test_topk_under_jit_and_vmap():
    rng = np.random.default_rng(5)
    nb, s_q, s_kv = 3, 7, 9
    q, k, w = _rand(rng, (nb, s_q, 2, 3)), _rand(rng, (nb, s_kv, 3)), _rand(rng, (nb, s_q, 2))
    kp = np.broadcast_to(np.arange(s_kv), (nb, s_kv))
    qp = np.broadcast_to(np.arange(2, 2 + s_q), (nb, s_q))
    want = oracle.topk(q, k, w, 4, qp, kp)
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
        want = oracle.score_row(q[i], k[i[0]][idx[i][ok]], w[i])
        np.testing.assert_allclose(scores[i][ok], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The fp8 scores (qk_dtype="float8_e4m3fn")


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
    ref8, ref_scale = oracle.quantize_fp8(x)
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
    q8, q_scale = oracle.quantize_fp8(q)
    k8, k_scale = oracle.quantize_fp8(k)
    vis = oracle.visible(qp, kp, qs, ks)
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


def test_visible_mask_bad_input():
    with pytest.raises(ValueError, match="kv_positions"):
        visible_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(TypeError, match="q_positions"):
        visible_mask(jnp.zeros(3), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        visible_mask(jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))
