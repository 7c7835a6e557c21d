"""Poisoned and edge-case inputs for every op and implementation (issue 49), against a float64
oracle that reads, for each query, only the keys that query may read.

The convention under test (docs/failure_behaviour.md): keys a query cannot see (other
documents, the future, invalid or unselected slots) never reach it, forward or backward; a NaN
or inf that a query reads (in its q or a key row it sees) makes its out and lse NaN, and its
gradients reach only what it read; an empty row is only a row with no valid slot (out 0, lse
+inf). Wide integer indices and lengths keep their meaning; ``S_q = 0`` works everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa import _native
from jax_dsa.ops.dense_mla import dense_mla
from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk, v4_indexer_kl_loss
from jax_dsa.ops.sparse_dense_mla import sparse_dense_mla
from jax_dsa.ops.sparse_mla import sparse_mla

SCALE = 0.3
HOST_IMPLS = ["xla"] + (["cpu"] if "cpu" in _native.available() else [])


# --------------------------------------------------------------------------------------------
# float64 oracle: one query at a time over the rows it reads


def oracle(q, kv, reads, sink, d_v, dout, scale=SCALE):
    """``q [S, H, D]``, ``kv [N, D]``, ``reads[t]`` the row ids query ``t`` reads (duplicates
    count), ``sink [H]``, ``dout [S, H, d_v]`` -> float64 ``out, lse, dq, dkv, dsink``.
    Every element a query reads that is not finite makes its logits NaN (the convention)."""
    q, kv, sink, dout = (np.asarray(x, np.float64) for x in (q, kv, sink, dout))
    s_q, h, _ = q.shape
    out = np.zeros((s_q, h, d_v))
    lse = np.full((s_q, h), np.inf)
    dq, dkv, dsink = np.zeros_like(q), np.zeros_like(kv), np.zeros(h)
    for t in range(s_q):
        rows = np.asarray(reads[t], np.int64)
        if rows.size == 0:
            continue
        k = kv[rows]
        for hh in range(h):
            with np.errstate(all="ignore"):
                s = scale * (k @ q[t, hh])
                if not (np.isfinite(k).all() and np.isfinite(q[t, hh]).all()):
                    s = np.full_like(s, np.nan)
                m = s.max()
                e = np.exp(s - m)
                lse[t, hh] = m + np.log(e.sum())
                p = np.exp(s - np.logaddexp(lse[t, hh], sink[hh]))
                o = p @ k[:, :d_v]
                out[t, hh] = o
                delta = dout[t, hh] @ o
                dp = k[:, :d_v] @ dout[t, hh]
                ds = p * (dp - delta)
                dq[t, hh] = scale * ds @ k
                np.add.at(dkv, rows, scale * ds[:, None] * q[t, hh][None, :])
                np.add.at(dkv[:, :d_v], rows, p[:, None] * dout[t, hh][None, :])
                dsink[hh] -= np.exp(sink[hh] - np.logaddexp(lse[t, hh], sink[hh])) * delta
    return out, lse, dq, dkv, dsink


def check_against(oracle_vals, got, reads, tol=1e-5):
    """Poisoned rows (NaN in the oracle) must be NaN, every other value equal to the oracle."""
    out_r, lse_r, dq_r, dkv_r, dsink_r = oracle_vals
    out, lse, dq, dkv = (np.asarray(x, np.float64) for x in got)
    bad = np.isnan(lse_r)  # [S, H]
    assert np.array_equal(np.isnan(lse), bad), (lse, lse_r)
    assert np.isnan(out[bad]).all()
    np.testing.assert_allclose(out[~bad], out_r[~bad], rtol=tol, atol=tol)
    np.testing.assert_allclose(lse[~bad], lse_r[~bad], rtol=tol, atol=tol)
    # Gradients: a poisoned row's dq is NaN; a key that a poisoned row reads gets NaN; every
    # other value is exact.
    bad_rows = bad.any(axis=1)
    assert np.isnan(dq[bad_rows]).all(axis=-1).any(axis=-1).all()
    np.testing.assert_allclose(dq[~bad_rows], dq_r[~bad_rows], rtol=tol, atol=tol)
    touched = np.zeros(dkv.shape[0], bool)
    for t in np.nonzero(bad_rows)[0]:
        touched[np.asarray(reads[t], np.int64)] = True
    assert np.isnan(dkv[touched]).any(axis=-1).all()
    np.testing.assert_allclose(dkv[~touched], dkv_r[~touched], rtol=tol, atol=tol)


def _value_and_grads(fn, q, kv, dout):
    (out, lse), vjp = jax.vjp(fn, q, kv)
    dq, dkv = vjp((dout, jnp.zeros_like(lse)))
    return out, lse, dq, dkv


# --------------------------------------------------------------------------------------------
# sparse_mla


def _sparse_case(rng, poison, where):
    s_q, s_kv, h, d, d_v, k = 6, 10, 2, 8, 4, 4
    q = rng.standard_normal((s_q, h, d)).astype(np.float32)
    kv = rng.standard_normal((s_kv, d)).astype(np.float32)
    # Row 5 is selected by rows 0 and 2; row 7 is unselected but sits behind row 4's invalid
    # slots (past topk_length, -1, out of range); row 1 reads nothing (empty).
    indices = np.array([[5, 1, 2, -1], [-1, -1, 10, 99], [3, 5, 5, 0], [0, 1, 2, 3],
                        [4, 7, 7, 7], [6, 8, -5, 9]], np.int32)
    topk_length = np.array([4, 4, 4, 4, 1, 4], np.int32)
    bad_row = {"selected": 5, "unselected": 7}[where]
    kv[bad_row, 3] = poison
    return q, kv, indices, topk_length, d_v


def _sparse_reads(indices, topk_length, s_kv):
    return [[int(i) for j, i in enumerate(row) if 0 <= i < s_kv and j < n]
            for row, n in zip(indices, topk_length)]


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["selected", "unselected"])
def test_sparse_mla_poisoned_key(impl, poison, where):
    rng = np.random.default_rng(0)
    q, kv, indices, topk_length, d_v = _sparse_case(rng, poison, where)
    dout = rng.standard_normal((q.shape[0], q.shape[1], d_v)).astype(np.float32)
    sink = np.array([0.5, -1.0], np.float32)
    fn = lambda q, kv: sparse_mla(q, kv, indices, sm_scale=SCALE, d_v=d_v, attn_sink=sink,  # noqa: E731
                                  topk_length=topk_length, implementation=impl)
    got = _value_and_grads(fn, q, kv, dout)
    reads = _sparse_reads(indices, topk_length, kv.shape[0])
    ref = oracle(q, kv, reads, sink, d_v, dout)
    check_against(ref, got, reads)
    assert np.array_equal(np.asarray(got[1])[1], [np.inf, np.inf])  # the empty row stays empty
    # max_logits agrees: NaN exactly on the poisoned rows, -inf on the empty one.
    _, lse, mx = sparse_mla(q, kv, indices, sm_scale=SCALE, d_v=d_v, topk_length=topk_length,
                            implementation=impl, return_max_logits=True)
    assert np.array_equal(np.isnan(mx), np.isnan(lse))
    assert np.array_equal(np.asarray(mx)[1], [-np.inf, -np.inf])


@pytest.mark.parametrize("impl", HOST_IMPLS)
def test_sparse_mla_poisoned_query_reaches_only_its_row(impl):
    rng = np.random.default_rng(1)
    q, kv, indices, topk_length, d_v = _sparse_case(rng, 0.0, "selected")
    q[2, 1, 0] = np.nan  # one head of one row
    dout = rng.standard_normal((q.shape[0], q.shape[1], d_v)).astype(np.float32)
    sink = np.full((2,), -np.inf, np.float32)
    fn = lambda q, kv: sparse_mla(q, kv, indices, sm_scale=SCALE, d_v=d_v,  # noqa: E731
                                  topk_length=topk_length, implementation=impl)
    got = _value_and_grads(fn, q, kv, dout)
    reads = _sparse_reads(indices, topk_length, kv.shape[0])
    check_against(oracle(q, kv, reads, sink, d_v, dout), got, reads)
    assert np.isfinite(np.asarray(got[1])[2, 0])  # the other head of that row is untouched


@pytest.mark.parametrize("impl", HOST_IMPLS)
def test_sparse_mla_wide_integers_keep_their_meaning(impl):
    """NumPy int64 indices 2**32+1 and -2**32+2 are out of range (invalid), not rows 1 and 2;
    int64 topk_length 2**32 means every slot, not 0."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((6, 8)).astype(np.float32)
    idx64 = np.array([[2**32 + 1, 0], [-(2**32) + 2, 1], [3, 2**40], [1, 2]], np.int64)
    idx32 = np.array([[-1, 0], [-1, 1], [3, -1], [1, 2]], np.int32)
    len64 = np.array([2**32, 2**32 + 1, 2, 2**33], np.int64)
    for a, b in [((idx64, None), (idx32, None)), ((idx32, len64), (idx32, None)),
                 ((idx64.astype(np.uint64) % (2**63), len64.astype(np.uint64)),
                  (np.where(idx64 >= 0, idx32, -1), None))]:
        o1, l1 = sparse_mla(q, kv, a[0], sm_scale=SCALE, d_v=4, topk_length=a[1],
                            implementation=impl)
        o2, l2 = sparse_mla(q, kv, b[0], sm_scale=SCALE, d_v=4, topk_length=b[1],
                            implementation=impl)
        np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
        np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))


def test_sm_scale_past_the_limit_is_refused():
    q = np.ones((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="sm_scale must be <= 10000"):
        sparse_mla(q, q[0], np.zeros((1, 1), np.int32), sm_scale=1e38, d_v=4)


# --------------------------------------------------------------------------------------------
# dense_mla and sparse_dense_mla


def _dense_reads(q_pos, kv_pos, q_seg, kv_seg):
    return [[s for s in range(len(kv_pos)) if kv_pos[s] <= q_pos[t]
             and (q_seg is None or kv_seg[s] == q_seg[t])] for t in range(len(q_pos))]


DENSE_CASES = {
    # The issue's packed row: document 0's first key is inf; document 1 must not see it.
    "packed": (np.array([0, 1, 2, 0, 1, 2]), np.array([0, 0, 0, 1, 1, 1]), 0, np.inf),
    # Causal: a NaN key at position 4, queries at positions 0..3 cannot see it.
    "causal": (np.array([0, 1, 2, 3, 3]), None, 4, np.nan),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense_mla_invisible_poison_never_reaches(case):
    pos, seg, bad, poison = DENSE_CASES[case]
    rng = np.random.default_rng(3)
    s_kv = max(len(pos), bad + 1)
    kv_pos = np.arange(s_kv) if seg is None else pos
    q = rng.standard_normal((len(pos), 4, 16)).astype(np.float32)
    kv = rng.standard_normal((s_kv, 16)).astype(np.float32)
    kv[bad] = poison
    dout = rng.standard_normal((len(pos), 4, 8)).astype(np.float32)
    fn = lambda q, kv: dense_mla(q, kv, sm_scale=SCALE, d_v=8, q_positions=pos,  # noqa: E731
                                 kv_positions=kv_pos, q_segment_ids=seg, kv_segment_ids=seg,
                                 implementation="xla")
    got = _value_and_grads(fn, q, kv, dout)
    reads = _dense_reads(pos, kv_pos, seg, seg)
    check_against(oracle(q, kv, reads, np.full((4,), -np.inf), 8, dout), got, reads)
    # Rows that cannot see the poison are finite: the packed case's document 1, and every row
    # of the causal case.
    safe_rows = [t for t, r in enumerate(reads) if bad not in r]
    assert safe_rows and np.isfinite(np.asarray(got[0])[safe_rows]).all()


def test_sparse_dense_mla_invisible_dense_poison_never_reaches():
    """A NaN kv_dense row at position 9: queries at positions 0..3 cannot see it."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((4, 8)).astype(np.float32)
    kvd = rng.standard_normal((10, 8)).astype(np.float32)
    kvd[9] = np.nan
    idx = np.array([[0, -1], [0, 1], [1, 2], [2, 3]], np.int32)

    def fn(q, kv, kvd):
        return sparse_dense_mla(q, kv, idx, kvd, sm_scale=SCALE, d_v=4,
                                q_positions=np.arange(4), kv_dense_positions=np.arange(10),
                                implementation="xla")

    (out, lse), vjp = jax.vjp(fn, q, kv, kvd)
    grads = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    for x in (out, lse) + tuple(grads[:2]):
        assert np.isfinite(np.asarray(x)).all()
    assert np.isfinite(np.asarray(grads[2])[:4]).all()  # the visible dense rows


def test_sparse_dense_mla_read_poison_reaches_out_and_lse():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((4, 8)).astype(np.float32)
    kvd = rng.standard_normal((4, 8)).astype(np.float32)
    kvd[2] = np.nan  # seen by queries at positions 2 and 3
    out, lse = sparse_dense_mla(q, kv, np.array([[0], [1], [2], [3]], np.int32), kvd,
                                sm_scale=SCALE, d_v=4, q_positions=np.arange(4),
                                kv_dense_positions=np.arange(4), implementation="xla")
    assert np.isnan(np.asarray(lse)).tolist() == [[False] * 2] * 2 + [[True] * 2] * 2
    assert np.isnan(np.asarray(out)[2:]).all() and np.isfinite(np.asarray(out)[:2]).all()


# --------------------------------------------------------------------------------------------
# indexer ops


def test_dense_kl_loss_ignores_a_poisoned_index_key_nobody_sees():
    rng = np.random.default_rng(6)
    s, hi, di, h, d = 5, 2, 8, 2, 8
    iq = rng.standard_normal((s, hi, di)).astype(np.float32)
    ik = rng.standard_normal((s + 1, di)).astype(np.float32)
    ik[s] = np.nan  # position s: after every query
    iw = rng.standard_normal((s, hi)).astype(np.float32)
    q = rng.standard_normal((s, h, d)).astype(np.float32)
    kv = rng.standard_normal((s + 1, d)).astype(np.float32)

    def loss(iq, ik, iw):
        return indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=SCALE, q_positions=np.arange(s),
                               kv_positions=np.arange(s + 1), implementation="xla")

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    assert np.isfinite(float(value))
    for g in grads:
        assert np.isfinite(np.asarray(g)[:s]).all()


def test_indexer_topk_with_no_queries():
    rng = np.random.default_rng(7)
    idx = indexer_topk(np.zeros((0, 2, 8), np.float32), rng.standard_normal((6, 8)),
                       np.zeros((0, 2), np.float32), topk=3, q_positions=np.zeros((0,), np.int32),
                       kv_positions=np.arange(6), implementation="xla")
    assert np.asarray(idx).shape == (0, 3)


@pytest.mark.parametrize("v4", [False, True])
def test_sparse_kl_losses_with_no_queries(v4):
    """S_q = 0 with an ``indices [0, K]`` array: a zero loss and zero gradients (the flattening
    once reshaped to ``(…, 0, -1)``, which cannot be inferred)."""
    rng = np.random.default_rng(8)
    ik, kv = rng.standard_normal((6, 8)), rng.standard_normal((6, 8))
    empty = dict(q_positions=np.zeros((0,), np.int32), kv_positions=np.arange(6),
                 indices=np.zeros((0, 4), np.int32), sm_scale=SCALE)
    q = np.zeros((0, 2, 8), np.float32)
    if v4:
        lse = np.zeros((0, 2), np.float32)
        loss = lambda iq, ik, iw: v4_indexer_kl_loss(iq, ik, iw, q, kv, lse, **empty)
    else:
        loss = lambda iq, ik, iw: indexer_kl_loss(iq, ik, iw, q, kv, **empty)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        np.zeros((0, 2, 8), np.float32), ik, np.zeros((0, 2), np.float32))
    assert float(value) == 0 and np.all(np.asarray(grads[1]) == 0)
    assert [np.shape(g) for g in grads] == [(0, 2, 8), (6, 8), (0, 2)]


def test_wide_positions_are_refused_not_wrapped():
    q = np.ones((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="q_positions must fit int32"):
        dense_mla(q, q[:, 0], sm_scale=SCALE, d_v=4, q_positions=np.array([0, 2**32], np.int64),
                  kv_positions=np.arange(2))


# --------------------------------------------------------------------------------------------
# "cuda" (SM90), GLM-5 widths: the same convention in the kernels and their glue

GLM5_SCALE = 1 / 16


def _bf16(x):
    return np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # a writable copy


def _check_bf16(ref, got, reads, strict=True):
    """As :func:`check_against` with bfloat16 tolerances (relative L2 <= 2e-2 per tensor).

    ``strict=False`` (an inf key): the kernels drop a logit of exactly -inf from lse, so a
    poisoned head need only have NaN in its out; every unpoisoned value is still checked."""
    out_r, lse_r, dq_r, dkv_r, _ = ref
    out, lse, dq, dkv = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in got)
    bad = np.isnan(lse_r)
    if strict:
        assert np.array_equal(np.isnan(lse), bad)
        assert np.isnan(out[bad]).all()
    else:
        assert np.isnan(out[bad]).any(axis=-1).all()
    bad_rows = bad.any(axis=1)
    touched = np.zeros(dkv.shape[0], bool)
    for t in np.nonzero(bad_rows)[0]:
        touched[np.asarray(reads[t], np.int64)] = True
    assert not bad_rows.any() or np.isnan(dq[bad_rows]).any()
    assert np.isnan(dkv[touched]).any(axis=-1).all()
    assert not np.isnan(lse[~bad]).any()
    for a, b in ((out[~bad], out_r[~bad]), (lse[~bad], lse_r[~bad]),
                 (dq[~bad_rows], dq_r[~bad_rows]), (dkv[~touched], dkv_r[~touched])):
        finite = np.isfinite(b)  # the empty row's lse is +inf in both
        assert np.array_equal(a[~finite], b[~finite]) and np.isfinite(a[finite]).all()
        assert np.linalg.norm(a[finite] - b[finite]) <= 2e-2 * np.linalg.norm(b[finite]) + 1e-6


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["selected", "unselected"])
@pytest.mark.gpu
def test_sparse_mla_cuda_poisoned_key(poison, where, deterministic):
    rng = np.random.default_rng(10)
    s_q, s_kv, h, d, d_v, k = 8, 96, 64, 576, 512, 64
    q = _bf16(rng.standard_normal((s_q, h, d)))
    kv = _bf16(rng.standard_normal((s_kv, d)))
    indices = np.stack([rng.permutation(s_kv - 1)[:k] for _ in range(s_q)]).astype(np.int32)
    indices[1] = -1  # an empty row
    bad = s_kv - 1  # selected by rows 0 and 3, or by none
    if where == "selected":
        indices[0, 5] = indices[3, 9] = bad
    kv[bad, 7] = poison
    dout = _bf16(rng.standard_normal((s_q, h, d_v)))
    sink = np.full((h,), -np.inf, np.float32)
    fn = lambda q, kv: sparse_mla(q, kv, indices, sm_scale=GLM5_SCALE, d_v=d_v,  # noqa: E731
                                  implementation="cuda", deterministic=deterministic)
    got = _value_and_grads(fn, jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
                           jnp.asarray(dout, jnp.bfloat16))
    reads = _sparse_reads(indices, np.full((s_q,), k), s_kv)
    ref = oracle(q, kv, reads, sink, d_v, dout, scale=GLM5_SCALE)
    _check_bf16(ref, got, reads, strict=np.isnan(poison))
    _, lse, mx = sparse_mla(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), indices,
                            sm_scale=GLM5_SCALE, d_v=d_v, implementation="cuda",
                            return_max_logits=True)
    assert np.array_equal(np.isnan(mx), np.isnan(lse))
    assert np.isneginf(np.asarray(mx)[1]).all()  # the empty row


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
@pytest.mark.gpu
def test_dense_mla_cuda_invisible_poison_never_reaches(case, deterministic):
    pos, seg, bad, poison = DENSE_CASES[case]
    rng = np.random.default_rng(11)
    s_kv = max(len(pos), bad + 1)
    kv_pos = np.arange(s_kv) if seg is None else pos
    h, d, d_v = 64, 576, 512
    q = _bf16(rng.standard_normal((len(pos), h, d)))
    kv = _bf16(rng.standard_normal((s_kv, d)))
    kv[bad] = poison
    dout = _bf16(rng.standard_normal((len(pos), h, d_v)))
    fn = lambda q, kv: dense_mla(q, kv, sm_scale=GLM5_SCALE, d_v=d_v, q_positions=pos,  # noqa: E731
                                 kv_positions=kv_pos, q_segment_ids=seg, kv_segment_ids=seg,
                                 implementation="cuda", deterministic=deterministic)
    got = _value_and_grads(fn, jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
                           jnp.asarray(dout, jnp.bfloat16))
    reads = _dense_reads(pos, kv_pos, seg, seg)
    ref = oracle(q, kv, reads, np.full((h,), -np.inf), d_v, dout, scale=GLM5_SCALE)
    _check_bf16(ref, got, reads, strict=np.isnan(poison))
