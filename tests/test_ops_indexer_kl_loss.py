"""indexer_kl_loss (jax_dsa.ops.indexer.kl_loss; the "xla" implementation) against float64 NumPy
brute force (tests/oracle.py) and finite differences: dense and sparse forms, invalid and
duplicate slots, packed documents, bf16 inputs with float32 accumulation, blocked memory,
argument errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import oracle
from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk
from test_ops_indexer_topk import _max_intermediate, _rand


@pytest.fixture
def x64():
    # Scoped to the test: other test files keep float32 defaults.
    with jax.enable_x64(True):
        yield


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
    want = oracle.kl_loss(*ins, 0.7, qp, kp)
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
    want = oracle.kl_loss(*ins, 0.4, qp, kp, indices=indices)
    got = indexer_kl_loss(
        *ins, sm_scale=0.4, q_positions=qp, kv_positions=kp, indices=indices, block_q=4
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # Duplicates really count as separate slots: dropping one changes the loss.
    dedup = indices.copy()
    dedup[0, 1, 1:3] = -1
    assert abs(oracle.kl_loss(*ins, 0.4, qp, kp, indices=dedup) - want) > 1e-3


def test_kl_sparse_on_indexer_topk_output():
    rng = np.random.default_rng(12)
    s = 9
    ins = _loss_inputs(rng, (), s, s)
    pos = np.arange(s)
    idx = indexer_topk(*ins[:3], topk=4, q_positions=pos, kv_positions=pos, block_q=4)
    want = oracle.kl_loss(*ins, 0.5, pos, pos, indices=np.asarray(idx))
    got = indexer_kl_loss(*ins, sm_scale=0.5, q_positions=pos, kv_positions=pos, indices=idx)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_kl_nan_in_index_q_propagates(sparse):
    """A NaN in one query's index_q makes the loss NaN (XLA:CPU's fused relu once dropped it)
    and never reaches an index_k row the query cannot see. The sparse form's gradients are NaN
    in that query's rows and in exactly the index_k rows it read; the dense form computes its
    scores on finite rows and puts the NaN back per score, so its gradients stay finite."""
    rng = np.random.default_rng(14)
    s, t, k = 64, 40, 16
    iq, ik, iw, q, kv = _loss_inputs(rng, (), s, s, h_i=32, d_i=16)
    pos = np.arange(s)
    idx = rng.integers(-2, s + 2, (s, k)) if sparse else None
    iq = jnp.asarray(iq).at[t, 3, 5].set(jnp.nan)
    loss = lambda iq, ik, iw: indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=0.5, q_positions=pos,
                                              kv_positions=pos, indices=idx)
    value, (d_iq, d_ik, d_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(iq, ik, iw)
    assert np.isnan(float(value))
    read = np.zeros(s, bool)
    if sparse:
        row = idx[t]
        read[row[(row >= 0) & (row <= t)]] = True
    else:
        read[: t + 1] = True
    assert read.sum() > 3
    nan_rows = np.isnan(np.asarray(d_ik)).any(-1)
    np.testing.assert_array_equal(nan_rows, read if sparse else np.zeros(s, bool))
    for name, g in (("d_iq", d_iq), ("d_w", d_w)):
        bad = ~np.isfinite(np.asarray(g)).reshape(s, -1).all(-1)
        np.testing.assert_array_equal(np.nonzero(bad)[0], [t] if sparse else [], err_msg=name)


def test_kl_sparse_inf_in_index_q_is_not_hidden_by_relu_and_empty_rows_stay_zero():
    """An inf in index_q whose dots with every selected key are -inf (relu would make them 0):
    the loss is NaN and that query's gradient rows too. A NaN in the index_q of a row without
    valid slots is never read: finite loss, zero gradients for that row."""
    rng = np.random.default_rng(15)
    s = 8
    iq, ik, iw, q, kv = _loss_inputs(rng, (), s, s, h_i=2, d_i=4, h=2, d_qk=8)
    ik[:, 0] = -np.abs(ik[:, 0]) - 0.1
    iw = np.abs(iw)
    idx = np.tile(np.arange(4), (s, 1))
    idx[6] = -1  # an empty row
    iq[5, 1, 0], iq[6, 0, 0] = np.inf, np.nan
    pos = np.arange(s)
    loss = lambda iq, ik, iw: indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=0.3, q_positions=pos,
                                              kv_positions=pos, indices=idx)
    value, (d_iq, d_ik, d_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(iq, ik, iw)
    assert np.isnan(float(value))
    for g in (d_iq, d_w):
        bad = ~np.isfinite(np.asarray(g)).reshape(s, -1).all(-1)
        np.testing.assert_array_equal(np.nonzero(bad)[0], [5])
        assert np.all(np.asarray(g)[6] == 0)
    np.testing.assert_array_equal(np.nonzero(np.isnan(np.asarray(d_ik)).any(-1))[0], [0, 1, 2, 3])
    iq[5, 1, 0] = 0.5  # only the empty row poisoned: nothing reads it
    value, (d_iq, _, d_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(iq, ik, iw)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(d_iq)))
    assert np.all(np.asarray(d_iq)[6] == 0) and np.all(np.asarray(d_w)[6] == 0)


def test_kl_packed_segments_and_empty_rows():
    rng = np.random.default_rng(13)
    q_seg = np.array([0, 0, 1, 1, 1, 5, 2, 2])  # document 5 has no keys: an empty row
    kv_seg = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    kp = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    qp = np.array([1, 2, 0, 1, 2, 2, 0, 1])
    ins = _loss_inputs(rng, (), q_seg.size, kv_seg.size)
    kw = dict(q_positions=qp, kv_positions=kp, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    want = oracle.kl_loss(*ins, 0.6, qp, kp, q_seg, kv_seg)
    got = indexer_kl_loss(*ins, sm_scale=0.6, block_q=2, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # The empty row does not count in the mean: it differs from a mean over all 8 rows.
    assert abs(want * 7 / 8 - want) > 1e-3
    idx = np.tile(np.arange(9), (8, 1))
    want = oracle.kl_loss(*ins, 0.6, qp, kp, q_seg, kv_seg, indices=idx)
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
        np.testing.assert_allclose(val, oracle.kl_loss(*ins, 0.5, qp, kp, indices=indices),
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
    want = oracle.kl_loss(*(np.asarray(x, np.float64) for x in ins), 0.5, pos, pos)
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
    want = [oracle.kl_loss(*(x[b] for x in ins), 0.5, pos[b], pos[b]) for b in range(nb)]
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


@pytest.mark.parametrize("sm_scale", [0.0, -0.5, float("nan"), float("inf")])
def test_kl_loss_refuses_a_scale_that_is_not_finite_and_positive(sm_scale):
    s, d = 8, 16
    x = np.ones((s, 2, d), np.float32)
    with pytest.raises(ValueError, match="sm_scale"):
        indexer_kl_loss(x, np.ones((s, d), np.float32), np.ones((s, 2), np.float32), x,
                        np.ones((s, d), np.float32), sm_scale=sm_scale, q_positions=np.arange(s),
                        kv_positions=np.arange(s))
