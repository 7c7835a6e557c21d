"""Tests for jax_dsa.models.deepseek_v4.hyper (DeepSeek V4's hyper-connections) against float64
NumPy oracles written from transformers 5.24's ``DeepseekV4HyperConnection`` /
``DeepseekV4HyperHead`` math (whole-model parity with transformers is in
tests/test_models_deepseek_v4_checkpoint.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.hyper import HyperConnection, HyperHead, sinkhorn

EPS = 1e-6


def _rms(x):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _sinkhorn(m, iters, eps):
    m = m / (m.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdims=True) + eps)
        m = m / (m.sum(-2, keepdims=True) + eps)
    return m


def _randomize(module, rng):
    for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        v = var.get_value()
        var.set_value(np.asarray(rng.standard_normal(v.shape) * 0.5 + (v.ndim == 1), v.dtype))


@pytest.fixture
def config():
    return get_config("deepseek-v4-tiny", hidden_size=16, hc_mult=3, hc_sinkhorn_iters=7)


def test_sinkhorn_matches_oracle_and_is_doubly_stochastic():
    rng = np.random.default_rng(0)
    m = np.exp(rng.standard_normal((5, 4, 4)))
    got = np.asarray(jax.jit(sinkhorn, static_argnums=(1, 2))(jnp.asarray(m, jnp.float32), 20,
                                                             EPS), np.float64)
    np.testing.assert_allclose(got, _sinkhorn(m, 20, EPS), rtol=2e-6)
    np.testing.assert_allclose(got.sum(-1), 1, atol=1e-3)
    np.testing.assert_allclose(got.sum(-2), 1, atol=1e-5)


def test_hyper_connection_matches_oracle(config):
    c = config
    n, d = c.hc_mult, c.hidden_size
    hc = HyperConnection(c, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    _randomize(hc, rng)
    x = rng.standard_normal((2, 5, n, d))
    collapsed, post, comb = nnx.jit(lambda m, x: m(x))(hc, jnp.asarray(x, jnp.float32))
    fn, base, scale = (np.asarray(p[...], np.float64) for p in (hc.fn, hc.base, hc.scale))
    m = _rms(x.reshape(2, 5, n * d)) @ fn.T
    pre = _sigmoid(m[..., :n] * scale[0] + base[:n]) + EPS
    want_post = 2 * _sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(2, 5, n, n)
    soft = np.exp(logits - logits.max(-1, keepdims=True))
    want_comb = _sinkhorn(soft / soft.sum(-1, keepdims=True) + EPS, c.hc_sinkhorn_iters, EPS)
    np.testing.assert_allclose(collapsed, np.einsum("bsj,bsjd->bsd", pre, x), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(post, want_post, rtol=1e-5)
    np.testing.assert_allclose(comb, want_comb, rtol=1e-5, atol=1e-6)
    out = rng.standard_normal((2, 5, d))
    new = jax.jit(HyperConnection.expand)(jnp.asarray(out, jnp.float32),
                                          jnp.asarray(x, jnp.float32), post, comb)
    # stream k: post[k] * out + sum_j comb[j, k] * x[j] (comb is used transposed)
    want = want_post[..., None] * out[:, :, None] + np.einsum("bsjk,bsjd->bskd", want_comb, x)
    np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hc_mult"):
        hc(jnp.zeros((2, 5, n + 1, d)))


def test_hyper_head_matches_oracle(config):
    c = config
    n, d = c.hc_mult, c.hidden_size
    head = HyperHead(c, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    _randomize(head, rng)
    x = rng.standard_normal((1, 4, n, d))
    got = nnx.jit(lambda m, x: m(x))(head, jnp.asarray(x, jnp.float32))
    fn, base, scale = (np.asarray(p[...], np.float64) for p in
                       (head.hc_fn, head.hc_base, head.hc_scale))
    pre = _sigmoid((_rms(x.reshape(1, 4, n * d)) @ fn.T) * scale[0] + base) + EPS
    np.testing.assert_allclose(got, np.einsum("bsj,bsjd->bsd", pre, x), rtol=1e-5, atol=1e-5)
    assert head.hc_fn[...].dtype == jnp.float32 and head.hc_fn[...].shape == (n, n * d)
