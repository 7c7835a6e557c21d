"""``grouped_matmul`` against a float64 NumPy oracle: forward, both gradients, edge-case group
sizes, and argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa import _native
from jax_dsa.ops.checks import int32_slots
from jax_dsa.ops.grouped_matmul import grouped_matmul
from jax_dsa.ops.grouped_matmul.op import clamp_group_sizes


def oracle(lhs, rhs, sizes, dout):
    """float64 ``out``, ``d_lhs``, ``d_rhs`` with the op's clamping of ``sizes``."""
    lhs, rhs, dout = (np.asarray(x, np.float64) for x in (lhs, rhs, dout))
    m = lhs.shape[0]
    out, d_lhs, d_rhs = np.zeros((m, rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes, np.int64)):
        end = min(start + max(int(size), 0), m)
        rows = slice(start, end)
        out[rows] = lhs[rows] @ rhs[g]
        d_lhs[rows] = dout[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ dout[rows]
        start = end
    return out, d_lhs, d_rhs


def run(lhs, rhs, sizes, dout, **kw):
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, **kw), lhs, rhs)
    return (out,) + vjp(dout)


SIZES = {
    "empty groups": [0, 5, 0, 7, 0],
    "one group holds every row": [0, 0, 12, 0, 0],
    "rows past the sum": [3, 1, 2, 0, 1],
    "negative and overflowing": [4, -3, 20, 5, 1],
}


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_matches_float64_oracle(name, dtype, tol):
    rng = np.random.default_rng(0)
    m, k, n = 12, 16, 8
    sizes = np.array(SIZES[name], np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    got = run(lhs, rhs, sizes, dout, implementation="xla")
    ref = oracle(*(np.asarray(jnp.asarray(x, jnp.float32)) for x in (lhs, rhs)), sizes,
                 np.asarray(jnp.asarray(dout, jnp.float32)))
    for a, b in zip(got, ref):
        a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        assert a.shape == b.shape
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b) + 1e-6


@pytest.mark.parametrize("groups", [1, 8, 64])
def test_many_groups_random_routing(groups):
    rng = np.random.default_rng(groups)
    m, k, n = 256, 32, 24
    sizes = rng.multinomial(m - 7, np.ones(groups) / groups).astype(np.int32)  # 7 rows past
    lhs, dout = rng.standard_normal((m, k)), rng.standard_normal((m, n))
    rhs = rng.standard_normal((groups, k, n))
    got = run(jnp.float32(lhs), jnp.float32(rhs), sizes, jnp.float32(dout))
    for a, b in zip(got, oracle(lhs, rhs, sizes, dout)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-4)
    assert not np.asarray(got[0])[m - 7:].any()  # rows past the groups are zero


def test_transposed_rhs_equals_plain():
    rng = np.random.default_rng(3)
    sizes = np.array([5, 0, 9, 2], np.int32)
    lhs, dout = rng.standard_normal((16, 8)), rng.standard_normal((16, 6))
    rhs = rng.standard_normal((4, 8, 6))
    plain = run(jnp.float32(lhs), jnp.float32(rhs), sizes, jnp.float32(dout))
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, transpose_rhs=True),
                       jnp.float32(lhs), jnp.float32(np.swapaxes(rhs, 1, 2)))
    d_lhs, d_rhs_t = vjp(jnp.float32(dout))
    for a, b in zip((out, d_lhs, jnp.swapaxes(d_rhs_t, 1, 2)), plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rhs's K 6 must equal lhs's K 8"):
        grouped_matmul(jnp.float32(lhs), jnp.float32(rhs), sizes, transpose_rhs=True)


def test_clamp_group_sizes():
    got = clamp_group_sizes(jnp.array([4, -3, 20, 5, 1]), 12)
    assert np.asarray(got).tolist() == [4, 0, 8, 0, 0]
    wide = int32_slots(np.array([2**33, 1], np.int64))  # as the op converts NumPy int64
    assert np.asarray(clamp_group_sizes(wide, 5)).tolist() == [5, 0]


@pytest.mark.parametrize("args,error,match", [
    (((4,), (2, 4, 3), (2,)), ValueError, "lhs must be"),
    (((4, 4), (4, 3), (2,)), ValueError, "rhs must be"),
    (((4, 4), (2, 5, 3), (2,)), ValueError, "rhs's K 5"),
    (((4, 4), (2, 4, 3), (3,)), ValueError, "group_sizes must be"),
])
def test_shape_errors_name_the_argument(args, error, match):
    lhs, rhs, sizes = (np.ones(s, np.float32) for s in args)
    with pytest.raises(error, match=match):
        grouped_matmul(lhs, rhs, sizes.astype(np.int32))


def test_dtype_errors():
    with pytest.raises(TypeError, match="share one float dtype"):
        grouped_matmul(np.ones((4, 4), np.float32), np.ones((2, 4, 3), np.float16),
                       np.array([2, 2]))
    with pytest.raises(TypeError, match="group_sizes must be an integer"):
        grouped_matmul(np.ones((4, 4), np.float32), np.ones((2, 4, 3), np.float32),
                       np.array([2.0, 2.0]))


@pytest.mark.parametrize("which,value", [("lhs", "x"), ("rhs", None), ("group_sizes", None),
                                         ("group_sizes", ["a", "b"])])
def test_non_arrays_are_named(which, value):
    args = dict(lhs=np.ones((4, 4), np.float32), rhs=np.ones((2, 4, 3), np.float32),
                group_sizes=np.array([2, 2]))
    args[which] = value
    with pytest.raises(TypeError, match=f"{which} must be a numeric array"):
        grouped_matmul(**args)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, "foo"])
def test_preferred_element_type_must_be_a_float_dtype(dtype):
    with pytest.raises(TypeError, match="preferred_element_type must be a float dtype"):
        grouped_matmul(np.ones((4, 4), np.float32), np.ones((2, 4, 3), np.float32),
                       np.array([2, 2]), preferred_element_type=dtype)


# --------------------------------------------------------------------------------------------
# "cuda" (SM90): the same contract at small shapes and at GLM-5's expert dims


def _rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("name", sorted(SIZES) + ["random 64"])
def test_cuda_matches_float64_oracle(name, transpose_rhs):
    rng = np.random.default_rng(11)
    if name == "random 64":
        m, sizes = 3000, rng.multinomial(2900, np.ones(64) / 64).astype(np.int32)
    else:
        m, sizes = 300, np.array(SIZES[name], np.int32) * 25
    k, n = 192, 320
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs,
                                                   implementation="cuda"), lhs, w)
    d_lhs, d_w = vjp(dout)
    d_rhs = jnp.swapaxes(d_w, 1, 2) if transpose_rhs else d_w
    ref = oracle(*(np.asarray(x.astype(jnp.float32)) for x in (lhs, rhs)), sizes,
                 np.asarray(dout.astype(jnp.float32)))
    for got, want in zip((out, d_lhs, d_rhs), ref):
        assert got.shape == want.shape and got.dtype == jnp.bfloat16
        assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
        assert _rel(got, want) <= 1e-2
    end = int(np.clip(np.cumsum(np.maximum(sizes, 0)), 0, m)[-1])
    assert not np.asarray(out.astype(jnp.float32))[end:].any()


# The models' expert products at 16K tokens: (rows = tokens x top-k, K, N, groups, transpose_rhs).
MODEL_DIMS = {
    "glm5 gate, 8 experts": (131072, 6144, 2048, 8, False),
    "glm5 gate, 256 experts": (131072, 6144, 2048, 256, False),
    "v4-flash gate, 256 experts": (98304, 4096, 2048, 256, True),
    "v4-flash down, 256 experts": (98304, 2048, 4096, 256, True),
    "v4-pro gate, 384 experts": (98304, 7168, 3072, 384, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODEL_DIMS))
def test_cuda_model_expert_dims(name):
    """GLM-5's and DeepSeek V4's expert products at 16K tokens (the layers' [E, out, in] weights
    with ``transpose_rhs``): forward and input gradient on sampled rows of 8 sampled groups,
    weight gradient on 64 sampled K rows of 2 groups, against float64."""
    m, k, n, groups, transpose_rhs = MODEL_DIMS[name]
    rng = np.random.default_rng(groups + k)
    sizes = rng.multinomial(m, np.ones(groups) / groups).astype(np.int32)
    shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    lhs = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    # in 8 calls: one would hold 4-byte random bits for every weight (34 GB at V4-Pro's)
    rhs = jnp.concatenate([jax.random.normal(key, (groups // 8,) + shape[1:], jnp.bfloat16) / 64
                           for key in jax.random.split(jax.random.key(1), 8)])
    dout = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs,
                                                   implementation="cuda"), lhs, rhs)
    d_lhs, d_rhs = vjp(dout)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    weight = lambda e: f64(rhs[e]).T if transpose_rhs else f64(rhs[e])  # noqa: E731  [K, N]
    for e in rng.choice(groups, min(groups, 8), replace=False):  # float64 stays cheap
        rows = starts[e] + rng.integers(0, max(sizes[e], 1), 3) if sizes[e] else []
        if len(rows):
            w = weight(e)
            assert _rel(out[rows], f64(lhs[rows]) @ w) <= 1e-2
            assert _rel(d_lhs[rows], f64(dout[rows]) @ w.T) <= 1e-2
    ks = np.sort(rng.choice(k, 64, replace=False))
    for e in rng.choice(groups, 2, replace=False):
        sl = slice(starts[e], starts[e] + sizes[e])
        want = f64(lhs[sl][:, ks]).T @ f64(dout[sl])  # [64, N]
        got = d_rhs[e][:, ks].T if transpose_rhs else d_rhs[e][ks]
        assert _rel(got, want) <= 1e-2


@pytest.mark.skipif("cuda" not in _native.available(), reason="CUDA module not built")
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_cuda_lowers_to_the_three_kernels(transpose_rhs):
    """Lowered for CUDA on the host: the forward and both gradients are our custom calls, and no
    ragged dot (XLA's dense expansion) is left."""
    w = (4, 128, 64) if transpose_rhs else (4, 64, 128)

    def step(a, b, s):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, s, transpose_rhs=transpose_rhs,
                                                       implementation="cuda"), a, b)
        return out, vjp(out)

    text = jax.jit(step).trace(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros(w, jnp.bfloat16),
                               jnp.zeros((4,), jnp.int32)).lower(
                                   lowering_platforms=("cuda",)).as_text()
    for kind in ("fwd", "dgrad", "wgrad"):
        assert f"jax_dsa_grouped_matmul_{kind}_cuda" in text
    assert "ragged_dot" not in text


def test_cuda_refuses_what_the_kernels_cannot_take():
    from jax_dsa.ops.grouped_matmul import cuda
    from jax_dsa.ops.grouped_matmul.config import Call

    bf = jnp.dtype(jnp.bfloat16)
    for call, match in [(Call(jnp.dtype(jnp.float32), 8, 64, 64, 2, bf), "bfloat16"),
                        (Call(bf, 8, 100, 64, 2, bf), "multiples of 64"),
                        (Call(bf, 8, 64, 64, 2000, bf), "1 to 1024 groups")]:
        why = cuda.supported(call)
        if why is not None and "not available" in why:
            pytest.skip(why)
        assert why is not None and match in why
