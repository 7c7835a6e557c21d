"""sparse_mla against a float64 NumPy oracle (forward and analytic gradients) and finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64
from jax.test_util import check_grads

import oracle
from jax_dsa import sparse_mla
from jax_dsa.ops import sparse_mla as sparse_mla_module

# Every test that takes `impl` runs once per host implementation this install has built ("cpu"
# is the C++ XLA FFI handler; tests/test_native.py fails when it was not built).
HOST_IMPLS = [i for i in ("xla", "cpu") if i in sparse_mla_module.AVAILABLE]

INT32_MAX = np.iinfo(np.int32).max
INT32_MIN = np.iinfo(np.int32).min


def make_inputs(rng, batch, s_q, s_kv, h, d, k, dtype=np.float32):
    q = rng.standard_normal(batch + (s_q, h, d)).astype(dtype)
    kv = rng.standard_normal(batch + (s_kv, d)).astype(dtype)
    idx = rng.integers(0, s_kv, batch + (s_q, k)).astype(np.int32)
    return q, kv, idx


def run(q, kv, idx, dout, return_max_logits=False, **kw):
    """out, lse, the vjp of out through the public op, and max_logits when asked for (then
    with nonzero cotangents into lse and max_logits, which the op must ignore)."""
    f = lambda q, kv, sink: sparse_mla(q, kv, idx, attn_sink=sink,
                                       return_max_logits=return_max_logits, **kw)
    sink = kw.pop("attn_sink", None)
    res, vjp = jax.vjp(f, q, kv, sink)
    assert isinstance(res, tuple) and len(res) == (3 if return_max_logits else 2)
    if not return_max_logits:
        dq, dkv, dsink = vjp((dout, jnp.zeros_like(res[1])))
        return res[0], res[1], dq, dkv, dsink
    out, lse, max_logits = res
    dq, dkv, dsink = vjp((dout, jnp.full_like(lse, 3.0), jnp.full_like(max_logits, -5.0)))
    return out, lse, dq, dkv, dsink, max_logits


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.fixture(params=HOST_IMPLS)
def impl(request):
    return request.param


def check_against_oracle(q, kv, idx, sm_scale, d_v, sink=None, length=None, tol=1e-5, impl=None):
    rng = np.random.default_rng(7)
    dout = rng.standard_normal(q.shape[:-1] + (d_v,)).astype(q.dtype)
    kw = dict(sm_scale=sm_scale, d_v=d_v, implementation=impl)
    if sink is not None:
        kw["attn_sink"] = jnp.asarray(sink, jnp.float32)
    if length is not None:
        kw["topk_length"] = jnp.asarray(length)
    args = (jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), dout)
    out, lse, dq, dkv, dsink, max_logits = run(*args, return_max_logits=True, **kw)
    # Without max_logits: the same values and gradients, bit for bit (one forward either way).
    for a, b in zip(run(*args, **kw), (out, lse, dq, dkv, dsink)):
        np.testing.assert_array_equal(a, b)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32 and max_logits.dtype == jnp.float32
    assert max_logits.shape == lse.shape == q.shape[:-1]
    atol = 1e-5 if tol < 1e-3 else 2e-2
    batch = q.shape[:-3]
    for b in np.ndindex(*batch):
        ref = oracle.sparse_mla(q[b], kv[b], idx[b], sm_scale, d_v, sink,
                                None if length is None else length[b], dout[b])
        assert rel_l2(out[b], ref[0]) <= tol
        finite = np.isfinite(ref[1])
        np.testing.assert_array_equal(np.isfinite(lse[b]), finite)
        assert np.all(lse[b][~finite] == np.inf)
        np.testing.assert_allclose(lse[b][finite], ref[1][finite], atol=atol)
        # max_logits: finite exactly where lse is, -inf (not +inf, not NaN) on empty rows.
        np.testing.assert_array_equal(np.isfinite(max_logits[b]), finite)
        assert np.all(max_logits[b][~finite] == -np.inf)
        np.testing.assert_allclose(max_logits[b][finite], ref[5][finite], atol=atol)
        assert rel_l2(dq[b], ref[2]) <= tol
        assert rel_l2(dkv[b], ref[3]) <= tol
    if sink is not None:
        ref_dsink = sum(
            oracle.sparse_mla(q[b], kv[b], idx[b], sm_scale, d_v, sink,
                              None if length is None else length[b], dout[b])[4]
            for b in np.ndindex(*batch))
        assert rel_l2(dsink, ref_dsink) <= max(tol, 1e-5)
    for x in (out, lse, dq, dkv, max_logits):
        assert not np.any(np.isnan(np.asarray(x, np.float64)))


def test_random_batched_float32(impl):
    rng = np.random.default_rng(0)
    q, kv, idx = make_inputs(rng, (2, 3), 70, 50, 4, 24, 16)
    check_against_oracle(q, kv, idx, 0.2, 16, impl=impl)


@pytest.mark.parametrize("d_qk,d_v", [(24, 24), (24, 16), (20, 1)])
def test_value_width(d_qk, d_v, impl):
    rng = np.random.default_rng(1)
    q, kv, idx = make_inputs(rng, (), 33, 40, 2, d_qk, 8)
    check_against_oracle(q, kv, idx, 0.3, d_v, impl=impl)


def test_invalid_slots_of_every_kind_and_duplicates(impl):
    rng = np.random.default_rng(2)
    q, kv, idx = make_inputs(rng, (2,), 40, 30, 3, 16, 12)
    bad = np.array([-1, -123456, 30, 31, 114514, INT32_MAX, INT32_MIN], np.int32)
    mask = rng.random(idx.shape) < 0.35
    idx = np.where(mask, rng.choice(bad, idx.shape), idx)
    idx[:, 5, :] = 7  # one row of duplicates: 12 slots of the same key
    idx[:, 6, :] = -1  # an empty row
    idx[:, 7, :] = np.where(np.arange(12) == 11, 3, -1)  # a single valid slot, last
    check_against_oracle(q, kv, idx, 0.25, 10, impl=impl)


@pytest.mark.parametrize("sink", ["finite", "neg_inf"])
def test_attention_sink(sink, impl):
    rng = np.random.default_rng(3)
    q, kv, idx = make_inputs(rng, (2,), 25, 20, 4, 16, 8)
    idx[0, 3] = -1  # empty row with a sink: still out = 0, lse = +inf, no gradient
    s = rng.standard_normal(4) * 2 if sink == "finite" else np.full(4, -np.inf)
    check_against_oracle(q, kv, idx, 0.3, 16, sink=s.astype(np.float32), impl=impl)
    # The sink enters neither lse nor max_logits, even when it is the largest logit.
    s[0] = 50.0 if sink == "finite" else s[0]
    kw = dict(sm_scale=0.3, d_v=16, implementation=impl, return_max_logits=True)
    with_sink = sparse_mla(q, kv, idx, attn_sink=jnp.asarray(s, jnp.float32), **kw)
    without = sparse_mla(q, kv, idx, **kw)
    np.testing.assert_array_equal(with_sink[1], without[1])
    np.testing.assert_array_equal(with_sink[2], without[2])


# The host implementations, and "cuda" (a gpu test: tests/conftest.py).
ALL_IMPLS = HOST_IMPLS + [pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("pattern", ["all", "mixed"])
@pytest.mark.parametrize("impl_name", ALL_IMPLS)
def test_attention_sink_at_plus_inf(pattern, impl_name):
    """A sink of +inf takes all of its head's mass: out, dq, dkv and d_attn_sink are exactly 0
    for that head (no NaN from inf - inf; the cuDNN frontend's DSA tests require the 0), while
    lse and max_logits stay sink-free and the other heads (finite and -inf sinks) match the
    float64 oracle. Rows without a valid slot keep out = 0, lse = +inf and no gradient."""
    rng = np.random.default_rng(21)
    if impl_name == "cuda":  # the kernels' contract: bfloat16, D_qk 576, d_v 512
        q, kv, idx = make_inputs(rng, (2,), 25, 40, 4, 576, 8)
        q, kv = np.asarray(jnp.asarray(q, jnp.bfloat16)), np.asarray(jnp.asarray(kv, jnp.bfloat16))
        d_v, sm_scale, tol, atol = 512, 576**-0.5, 2e-2, 2e-2
    else:
        q, kv, idx = make_inputs(rng, (2,), 25, 20, 4, 16, 8)
        d_v, sm_scale, tol, atol = 16, 0.3, 1e-5, 1e-5
    idx[0, 3] = -1  # rows without a valid slot
    idx[1, 7] = -1
    idx[1, 8, :5] = -1  # and one with a few
    if pattern == "all":
        sink = np.full(4, np.inf, np.float32)
    else:  # +inf, finite, -inf and +inf heads
        sink = np.array([np.inf, 0.7, -np.inf, np.inf], np.float32)
    pos_inf = np.isposinf(sink)
    dout = rng.standard_normal(q.shape[:-1] + (d_v,)).astype(q.dtype)
    kw = dict(sm_scale=sm_scale, d_v=d_v, implementation=impl_name, attn_sink=jnp.asarray(sink))
    out, lse, dq, dkv, dsink, max_logits = (
        np.asarray(x, np.float64)
        for x in run(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(dout),
                     return_max_logits=True, **kw))
    for name, x in zip(("out", "lse", "dq", "dkv", "d_attn_sink", "max_logits"),
                       (out, lse, dq, dkv, dsink, max_logits)):
        assert not np.any(np.isnan(x)), name
    # The +inf heads: exact zeros.
    np.testing.assert_array_equal(out[..., pos_inf, :], 0)
    np.testing.assert_array_equal(dq[..., pos_inf, :], 0)
    np.testing.assert_array_equal(dsink[pos_inf], 0)
    if pos_inf.all():
        np.testing.assert_array_equal(dkv, 0)
    # Everything else against the float64 oracle (whose d_attn_sink is inf/inf = NaN on the
    # +inf heads; its out, dq and dkv take exact zeros from them).
    other = ~pos_inf
    ref_dsink = np.zeros(4)
    for b in range(2):
        with np.errstate(invalid="ignore"):
            r_out, r_lse, r_dq, r_dkv, r_dsink, r_max = oracle.sparse_mla(
                q[b], kv[b], idx[b], sm_scale, d_v, sink, None, dout[b])
        ref_dsink = ref_dsink + r_dsink
        assert np.all(np.isfinite(r_out)) and np.all(np.isfinite(r_dq))
        assert np.all(np.isfinite(r_dkv))
        empty = ~np.isfinite(r_lse)
        assert empty[3 if b == 0 else 7].all()
        np.testing.assert_array_equal(np.isfinite(lse[b]), ~empty)
        assert np.all(lse[b][empty] == np.inf) and np.all(max_logits[b][empty] == -np.inf)
        np.testing.assert_array_equal(out[b][empty], 0)
        np.testing.assert_array_equal(dq[b][empty], 0)
        np.testing.assert_allclose(lse[b][~empty], r_lse[~empty], atol=atol)
        np.testing.assert_allclose(max_logits[b][~empty], r_max[~empty], atol=atol)
        if other.any():
            assert rel_l2(out[b][..., other, :], r_out[..., other, :]) <= tol
            assert rel_l2(dq[b][..., other, :], r_dq[..., other, :]) <= tol
            assert rel_l2(dkv[b], r_dkv) <= tol
    if other.any():
        assert rel_l2(dsink[other], ref_dsink[other]) <= max(tol, 1e-5)
        assert np.abs(ref_dsink[other]).max() > 1e-3  # the finite sink does take a gradient
        assert np.abs(dkv).max() > 1e-3


def test_sink_at_minus_inf_equals_no_sink(impl):
    rng = np.random.default_rng(4)
    q, kv, idx = make_inputs(rng, (), 10, 12, 2, 8, 4)
    a = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=8, implementation=impl)
    b = sparse_mla(q, kv, idx, sm_scale=0.5, d_v=8, attn_sink=jnp.full((2,), -jnp.inf),
                   implementation=impl)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_topk_length_with_invalid_slots_and_zero_length(impl):
    rng = np.random.default_rng(5)
    q, kv, idx = make_inputs(rng, (2,), 30, 25, 2, 16, 10)
    idx[rng.random(idx.shape) < 0.2] = -1
    length = rng.integers(0, 11, (2, 30)).astype(np.int32)
    length[0, :3] = 0
    check_against_oracle(q, kv, idx, 0.3, 12, length=length, impl=impl)


def test_fewer_keys_than_slots(impl):
    rng = np.random.default_rng(6)
    q, kv, _ = make_inputs(rng, (), 20, 5, 2, 8, 1)
    idx = rng.integers(-2, 9, (20, 16)).astype(np.int32)  # S_kv = 5 < K = 16
    check_against_oracle(q, kv, idx, 0.3, 8, sink=np.array([0.5, -1.0], np.float32), impl=impl)


def test_wide_indices_do_not_wrap(impl):
    """An int64 index past 2**32 is invalid; it must not become a small row id when cast."""
    rng = np.random.default_rng(17)
    q, kv, idx = make_inputs(rng, (), 6, 8, 2, 8, 4)
    with enable_x64(True):
        wide = idx.astype(np.int64)
        wide[:, 0] = 2**32 + 3
        a = sparse_mla(q, kv, wide, sm_scale=0.3, d_v=8, implementation=impl)
    narrow = idx.copy()
    narrow[:, 0] = -1
    b = sparse_mla(q, kv, narrow, sm_scale=0.3, d_v=8, implementation=impl)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-7)


def test_no_kv_rows_at_all(impl):
    """S_kv = 0: every slot is invalid, so every row is empty."""
    rng = np.random.default_rng(16)
    q, _, _ = make_inputs(rng, (2,), 6, 1, 2, 8, 1)
    kv = np.zeros((2, 0, 8), np.float32)
    idx = rng.integers(-2, 3, (2, 6, 4)).astype(np.int32)
    f = lambda q, kv: sparse_mla(q, kv, idx, sm_scale=0.3, d_v=8, implementation=impl,
                                 return_max_logits=True)
    (out, lse, max_logits), vjp = jax.vjp(f, q, kv)
    np.testing.assert_array_equal(out, 0)
    assert np.all(lse == np.inf)
    assert max_logits.shape == lse.shape and np.all(max_logits == -np.inf)
    dq, dkv = vjp((jnp.ones_like(out), jnp.zeros_like(lse), jnp.ones_like(max_logits)))
    np.testing.assert_array_equal(dq, 0)
    assert dkv.shape == kv.shape


def test_nan_in_an_unselected_row_does_not_leak(impl):
    """Invalid slots are never read: a NaN kv row that no valid slot selects changes nothing."""
    rng = np.random.default_rng(8)
    q, kv, idx = make_inputs(rng, (), 16, 10, 2, 8, 6)
    idx = np.where(idx == 0, 1, idx)  # row 0 is selected by no valid slot
    idx[:, 0] = -1
    kv_nan = kv.copy()
    kv_nan[0] = np.nan
    a = sparse_mla(q, kv, idx, sm_scale=0.4, d_v=8, implementation=impl)[0]
    b = sparse_mla(q, kv_nan, idx, sm_scale=0.4, d_v=8, implementation=impl)[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 4e-3)])
def test_half_precision(dtype, tol, impl):
    rng = np.random.default_rng(9)
    q, kv, idx = make_inputs(rng, (2,), 40, 60, 4, 32, 24)
    idx[rng.random(idx.shape) < 0.2] = -1
    q, kv = np.asarray(jnp.asarray(q, dtype)), np.asarray(jnp.asarray(kv, dtype))
    check_against_oracle(q, kv, idx, 32**-0.5, 16, sink=np.full(4, 0.3, np.float32), tol=tol,
                         impl=impl)


@pytest.mark.parametrize("return_max_logits", [False, True])
def test_finite_differences_float64(impl, return_max_logits):
    with enable_x64(True):
        rng = np.random.default_rng(10)
        q, kv, idx = make_inputs(rng, (2,), 9, 7, 2, 6, 5, np.float64)
        idx[0, 2] = -1
        idx[1, 3, :2] = 4
        sink = jnp.asarray(rng.standard_normal(2))
        length = jnp.asarray(rng.integers(1, 6, (2, 9)), jnp.int32)

        def f(q, kv, sink):
            out = sparse_mla(q, kv, jnp.asarray(idx), sm_scale=0.7, d_v=4, attn_sink=sink,
                             topk_length=length, implementation=impl,
                             return_max_logits=return_max_logits)[0]
            return out

        check_grads(f, (jnp.asarray(q), jnp.asarray(kv), sink), order=1, modes=("rev",),
                    atol=1e-6, rtol=1e-6)


def test_jit_vmap_and_checkpoint_agree(impl):
    rng = np.random.default_rng(11)
    q, kv, idx = make_inputs(rng, (3,), 20, 16, 2, 8, 6)
    kw = dict(sm_scale=0.3, d_v=8, implementation=impl)
    eager = sparse_mla(q, kv, idx, **kw)
    jitted = jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, **kw))(q, kv, idx)
    vmapped = jax.vmap(lambda q, kv, i: sparse_mla(q, kv, i, **kw))(q, kv, idx)
    for other in (jitted, vmapped):
        np.testing.assert_allclose(other[0], eager[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(other[1], eager[1], rtol=1e-6, atol=1e-6)

    def loss(q, kv, idx=idx):
        return jnp.sum(jnp.sin(sparse_mla(q, kv, idx, **kw)[0]))

    policy = jax.checkpoint_policies.save_only_these_names(*sparse_mla_module.RESIDUAL_NAMES)
    g_plain = jax.grad(loss, (0, 1))(q, kv)
    g_remat = jax.grad(jax.checkpoint(loss, policy=policy), (0, 1))(q, kv)
    g_nothing = jax.jit(jax.grad(jax.checkpoint(loss), (0, 1)))(q, kv)
    g_vmap = jax.vmap(jax.grad(lambda q, kv, i: loss(q[None], kv[None], i[None]), (0, 1)))(
        q, kv, idx)
    for g in (g_remat, g_nothing, g_vmap):
        for a, b in zip(g, g_plain):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("return_max_logits", [False, True])
def test_residual_names_are_saved_by_a_names_policy(capsys, impl, return_max_logits):
    rng = np.random.default_rng(12)
    q, kv, idx = make_inputs(rng, (), 8, 8, 2, 8, 4)
    policy = jax.checkpoint_policies.save_only_these_names(*sparse_mla_module.RESIDUAL_NAMES)
    f = jax.checkpoint(
        lambda q, kv: sparse_mla(q, kv, idx, sm_scale=0.3, d_v=8, implementation=impl,
                                 return_max_logits=return_max_logits)[0].sum(),
        policy=policy)
    jax.ad_checkpoint.print_saved_residuals(f, q, kv)
    saved = capsys.readouterr().out
    assert "named 'sparse_mla_out'" in saved and "named 'sparse_mla_lse'" in saved, saved


def test_max_logits_takes_no_gradient(impl):
    """A cotangent into max_logits is ignored (documented): a loss of max_logits alone has zero
    gradient, and adding it to a loss of out leaves out's gradient unchanged."""
    rng = np.random.default_rng(14)
    q, kv, idx = make_inputs(rng, (2,), 12, 10, 3, 8, 5)
    idx[0, 4] = -1  # an empty row: -inf max_logits must not turn into NaN gradients
    sink = jnp.asarray(rng.standard_normal(3), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 12, 3, 8)), jnp.float32)
    kw = dict(sm_scale=0.3, d_v=8, implementation=impl)

    def loss(q, kv, sink, use_out, use_max):
        out, _, max_logits = sparse_mla(q, kv, idx, attn_sink=sink, return_max_logits=True, **kw)
        finite = jnp.where(jnp.isfinite(max_logits), max_logits, 0)
        return use_out * jnp.sum(out * w) + use_max * jnp.sum(finite ** 2)

    grad = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=(3, 4))
    for g in grad(q, kv, sink, 0.0, 1.0):
        np.testing.assert_array_equal(g, 0)
    plain = jax.grad(lambda q, kv, s: jnp.sum(
        sparse_mla(q, kv, idx, attn_sink=s, **kw)[0] * w), (0, 1, 2))(q, kv, sink)
    for a, b in zip(grad(q, kv, sink, 1.0, 1.0), plain):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_return_max_logits_under_jit_vmap_and_checkpoint(impl):
    rng = np.random.default_rng(15)
    q, kv, idx = make_inputs(rng, (3,), 20, 16, 2, 8, 6)
    idx[1, 2] = -1
    kw = dict(sm_scale=0.3, d_v=8, implementation=impl)
    pair = sparse_mla(q, kv, idx, **kw)
    assert isinstance(pair, tuple) and len(pair) == 2  # the default is unchanged
    eager = sparse_mla(q, kv, idx, return_max_logits=True, **kw)
    jitted = jax.jit(lambda q, kv, i: sparse_mla(q, kv, i, return_max_logits=True, **kw))(
        q, kv, idx)
    vmapped = jax.vmap(lambda q, kv, i: sparse_mla(q, kv, i, return_max_logits=True, **kw))(
        q, kv, idx)
    for i, name in enumerate(("out", "lse")):
        np.testing.assert_array_equal(eager[i], pair[i], err_msg=name)
    for other in (jitted, vmapped):
        assert len(other) == 3
        for a, b in zip(other, eager):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.all(eager[2][1, 2] == -np.inf)

    # Under a names policy the saved residuals stay out and lse; grads equal the plain ones.
    policy = jax.checkpoint_policies.save_only_these_names(*sparse_mla_module.RESIDUAL_NAMES)

    def loss(q, kv):
        out, _, max_logits = sparse_mla(q, kv, idx, return_max_logits=True, **kw)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(max_logits), max_logits, 0))

    plain = jax.grad(lambda q, kv: jnp.sum(jnp.sin(sparse_mla(q, kv, idx, **kw)[0])), (0, 1))(
        q, kv)
    for g in (jax.grad(jax.checkpoint(loss, policy=policy), (0, 1))(q, kv),
              jax.jit(jax.grad(jax.checkpoint(loss), (0, 1)))(q, kv)):
        for a, b in zip(g, plain):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_integer_inputs_take_no_gradient(impl):
    rng = np.random.default_rng(13)
    q, kv, idx = make_inputs(rng, (), 8, 8, 2, 8, 4)
    g = jax.grad(lambda q, i: sparse_mla(q, kv, i, sm_scale=0.3, d_v=8,
                                         implementation=impl)[0].sum(),
                 argnums=(0, 1), allow_int=True)(q, idx)
    assert g[1].dtype == jax.dtypes.float0


def test_memory_is_bounded_by_query_blocks():
    """No [S_q, K, D_qk] gather and no [S_q, H, S_kv] tensor: temporaries grow linearly in S."""
    h, d, k = 4, 64, 256

    def temp_bytes(s):
        q = jax.ShapeDtypeStruct((s, h, d), jnp.float32)
        kv = jax.ShapeDtypeStruct((s, d), jnp.float32)
        idx = jax.ShapeDtypeStruct((s, k), jnp.int32)
        loss = lambda q, kv, idx: sparse_mla(q, kv, idx, sm_scale=0.1, d_v=d,
                                             implementation="xla")[0].sum()
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(q, kv, idx).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(4096)
    assert large < 4.5 * small, (small, large)  # linear (x4), not quadratic (x16)
    assert large < 4096 * k * d * 4 / 4, large  # far below the whole-sequence gather


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        (((4, 2, 8), (6, 8), (4, 3)), {}, None, None),
        (((4, 8), (6, 8), (4, 3)), {}, ValueError, "q must be"),
        (((4, 0, 8), (6, 8), (4, 3)), {}, ValueError, "H >= 1"),
        (((4, 2, 8), (1, 6, 8), (4, 3)), {}, ValueError, "kv must be"),
        (((4, 2, 8), (6, 8), (1, 4, 3)), {}, ValueError, "indices must be"),
        (((4, 2, 8), (6, 7), (4, 3)), {}, ValueError, "D_qk"),
        (((4, 2, 8), (6, 8), (5, 3)), {}, ValueError, "S_q"),
        (((4, 2, 8), (6, 8), (4, 3)), {"d_v": 9}, ValueError, "d_v"),
        (((4, 2, 8), (6, 8), (4, 3)), {"sm_scale": None}, TypeError, "sm_scale"),
        (((4, 2, 8), (6, 8), (4, 3)), {"sm_scale": 0.0}, ValueError, "sm_scale"),
        (((4, 2, 8), (6, 8), (4, 3)), {"sm_scale": -0.5}, ValueError, "sm_scale"),
        (((4, 2, 8), (6, 8), (4, 3)), {"sm_scale": float("inf")}, ValueError, "sm_scale"),
        (((4, 2, 8), (6, 8), (4, 3)), {"sm_scale": float("nan")}, ValueError, "sm_scale"),
        (((4, 2, 8), (6, 8), (4, 3)), {"return_max_logits": np.bool_(True)}, None, None),
        (((4, 2, 8), (6, 8), (4, 3)), {"attn_sink": np.zeros(3, np.float32)}, ValueError,
         "attn_sink"),
        (((4, 2, 8), (6, 8), (4, 3)), {"topk_length": np.zeros(3, np.int32)}, ValueError,
         "topk_length"),
        (((4, 2, 8), (6, 8), (4, 3)), {"topk_length": np.zeros(4, np.float32)}, TypeError,
         "topk_length"),
        (((4, 2, 8), (6, 8), (4, 3)), {"implementation": "tpu"}, ValueError, "implementation"),
        (((4, 2, 8), (6, 8), (4, 3)), {"return_max_logits": 1}, TypeError, "return_max_logits"),
        (((4, 2, 8), (6, 8), (4, 3)), {"return_max_logits": "yes"}, TypeError,
         "return_max_logits"),
        (((4, 2, 8), (6, 8), (4, 3)), {"return_max_logits": None}, TypeError,
         "return_max_logits"),
        (((4, 2, 8), (6, 8), (4, 3)), {"implementation": "cuda"}, ValueError, "D_qk"),
        # float32 is refused by the cuda backward (bfloat16 only), or "cuda" is not built.
        (((4, 2, 576), (6, 576), (4, 3)), {"implementation": "cuda", "d_v": 512},
         *((ValueError, "bfloat16") if "cuda" in sparse_mla_module.AVAILABLE
           else (NotImplementedError, "cuda"))),
    ],
)
def test_bad_inputs_name_the_argument(args, kwargs, exc, match):
    qs, kvs, ids = args
    kw = {"sm_scale": 0.1, "d_v": 8, **kwargs}
    q, kv, idx = np.ones(qs, np.float32), np.ones(kvs, np.float32), np.zeros(ids, np.int32)
    if exc is None:
        sparse_mla(q, kv, idx, **kw)
        return
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda q, kv, i: sparse_mla(q, kv, i, **kw), q, kv, idx)


def test_float_indices_and_mixed_dtypes_are_rejected():
    q, kv = np.ones((4, 2, 8), np.float32), np.ones((6, 8), np.float32)
    with pytest.raises(TypeError, match="indices"):
        sparse_mla(q, kv, np.zeros((4, 3), np.float32), sm_scale=0.1, d_v=8)
    with pytest.raises(TypeError, match="q and kv"):
        sparse_mla(q, kv.astype(np.float16), np.zeros((4, 3), np.int32), sm_scale=0.1, d_v=8)
    with pytest.raises(TypeError, match="sm_scale"):
        sparse_mla(q, kv, np.zeros((4, 3), np.int32), d_v=8)
