"""Manifold-constrained hyper-connections (mHC) of DeepSeek V4: ``hc_mult`` residual streams.

Math and parameter names: transformers 5.24 ``DeepseekV4HyperConnection`` (``fn``, ``base``,
``scale``) and ``DeepseekV4HyperHead`` (``hc_fn``, ``hc_base``, ``hc_scale``); DeepSeek-V4
report §2.2; Xie et al., 2026 (mHC: manifold-constrained hyper-connections).

The residual of a V4 decoder is ``X [B, S, n, D]`` (``n = hc_mult`` streams). Around each block
``F`` (attention or MoE), with ``x = rms(flatten(X))`` (no weight, float32) and
``m = fn @ x`` split into ``n``, ``n`` and ``n * n`` parts ``(m_pre, m_post, m_comb)``::

    pre  = sigmoid(scale[0] * m_pre + base_pre) + hc_eps                 [n]
    post = 2 * sigmoid(scale[1] * m_post + base_post)                    [n]
    comb = Sinkhorn(softmax_rows(scale[2] * m_comb + base_comb) + hc_eps)  [n, n]
    X'   = post[k] * F(sum_j pre[j] X[j]) + sum_j comb[j, k] X[j]        (stream k)

``Sinkhorn`` divides by the column sums, then ``hc_sinkhorn_iters - 1`` times by the row sums and
the column sums (each sum plus ``hc_eps``): ``comb`` is nearly doubly stochastic. The hyper head
collapses the streams before the final norm: ``sum_j (sigmoid(hc_scale * (hc_fn @ x)_j +
hc_base_j) + hc_eps) X[j]``. All of it runs in float32 (transformers keeps these modules in
float32); the collapsed block input and the new streams come back in the streams' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.attention import unweighted_rms_norm
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.nn.layers import param

_HIGHEST = jax.lax.Precision.HIGHEST


def _mixes(streams, fn, eps: float):
    """``fn @ rms(flatten(streams))`` in float32: ``[B, S, n, D]`` -> ``[B, S, fn.shape[0]]``."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = unweighted_rms_norm(flat, eps)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(jnp.float32), precision=_HIGHEST)


def _collapse(weights, streams):
    """``sum_j weights[..., j] * streams[..., j, :]`` in float32, cast to the streams' dtype."""
    out = jnp.einsum("...j,...jd->...d", weights, streams.astype(jnp.float32), precision=_HIGHEST)
    return out.astype(streams.dtype)


def sinkhorn(comb, iters: int, eps: float):
    """transformers' Sinkhorn-Knopp projection of ``comb [..., n, n]`` (positive entries): one
    column normalisation, then ``iters - 1`` row-and-column rounds, each sum plus ``eps``."""
    def rows_then_cols(_, m):
        m = m / (m.sum(-1, keepdims=True) + eps)
        return m / (m.sum(-2, keepdims=True) + eps)

    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    # a loop, not unrolled: 20 rounds per site would dominate the compiled graph
    return jax.lax.fori_loop(0, iters - 1, rows_then_cols, comb)


class HyperConnection(nnx.Module):
    """One mHC site (``attn_hc`` or ``ffn_hc`` of a decoder layer).

    Parameters (float32): ``fn [(2 + n) * n, n * hidden_size]`` (normal init, std
    ``initializer_range``), ``base [(2 + n) * n]`` (zeros), ``scale [3]`` (ones), ``n = hc_mult``.
    """

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        n = c.hc_mult
        self.config = config
        width = (2 + n) * n
        self.fn = param(rngs, nnx.initializers.normal(c.initializer_range),
                        (width, n * c.hidden_size), jnp.float32, ("hc_mix", "hc_embed"))
        self.base = param(rngs, nnx.initializers.zeros, (width,), jnp.float32, ("hc_mix",))
        self.scale = param(rngs, nnx.initializers.ones, (3,), jnp.float32, ("hc_mix",))

    def __call__(self, streams):
        """The block input and the mixes for ``streams``.

        Args:
          streams: ``[B, S, hc_mult, hidden_size]`` residual streams (any float dtype).

        Returns:
          ``(collapsed [B, S, hidden_size] in the streams' dtype, post [B, S, n] float32,
          comb [B, S, n, n] float32)``; feed the block's output to :meth:`expand`.

        Raises:
          ValueError: ``streams`` not ``[..., hc_mult, hidden_size]``.
        """
        c = self.config
        n = c.hc_mult
        if streams.shape[-2:] != (n, c.hidden_size):
            raise ValueError(
                f"HyperConnection: streams must end in (hc_mult, hidden_size) = "
                f"{(n, c.hidden_size)}, got {streams.shape}"
            )
        m = _mixes(streams, self.fn[...], c.rms_norm_eps)
        base = self.base[...].astype(jnp.float32)
        scale = self.scale[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
        logits = m[..., 2 * n:] * scale[2] + base[2 * n:]
        comb = jax.nn.softmax(logits.reshape(*logits.shape[:-1], n, n), axis=-1) + c.hc_eps
        comb = sinkhorn(comb, c.hc_sinkhorn_iters, c.hc_eps)
        return _collapse(pre, streams), post, comb

    @staticmethod
    def expand(block_out, streams, post, comb):
        """New streams ``post[k] * block_out + sum_j comb[j, k] * streams[j]``.

        Args:
          block_out: ``[B, S, hidden]``; streams: ``[B, S, n, hidden]``; post ``[B, S, n]``,
            comb ``[B, S, n, n]`` from :meth:`__call__`.

        Returns:
          ``[B, S, n, hidden]`` in the streams' dtype (the mixes are cast to it first, as in
          transformers).
        """
        dtype = streams.dtype
        mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(dtype), streams,
                           precision=_HIGHEST)
        return post.astype(dtype)[..., None] * block_out.astype(dtype)[..., None, :] + mixed


class HyperHead(nnx.Module):
    """The final collapse of the streams (transformers ``model.hc_head``).

    Parameters (float32): ``hc_fn [n, n * hidden_size]`` (normal init), ``hc_base [n]`` (zeros),
    ``hc_scale [1]`` (ones).
    """

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        n = c.hc_mult
        self.config = config
        self.hc_fn = param(rngs, nnx.initializers.normal(c.initializer_range),
                           (n, n * c.hidden_size), jnp.float32, ("hc_mix", "hc_embed"))
        self.hc_base = param(rngs, nnx.initializers.zeros, (n,), jnp.float32, ("hc_mix",))
        self.hc_scale = param(rngs, nnx.initializers.ones, (1,), jnp.float32, ("hc_mix",))

    def __call__(self, streams):
        """``streams [B, S, hc_mult, hidden]`` -> ``[B, S, hidden]`` in the streams' dtype."""
        c = self.config
        if streams.shape[-2:] != (c.hc_mult, c.hidden_size):
            raise ValueError(
                f"HyperHead: streams must end in (hc_mult, hidden_size) = "
                f"{(c.hc_mult, c.hidden_size)}, got {streams.shape}"
            )
        m = _mixes(streams, self.hc_fn[...], c.rms_norm_eps)
        pre = jax.nn.sigmoid(m * self.hc_scale[...].astype(jnp.float32)
                             + self.hc_base[...].astype(jnp.float32)) + c.hc_eps
        return _collapse(pre, streams)


__all__ = ["HyperConnection", "HyperHead", "sinkhorn"]
