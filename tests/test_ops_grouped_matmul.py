"""``grouped_matmul`` against a float64 NumPy oracle: forward, both gradients, edge-case group
sizes, and argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
