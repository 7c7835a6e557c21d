"""The KV compressor of DeepSeek V4's compressed layers (CSA ratio 4 with overlapping windows and
its indexer; HCA ratio 128 without), in transformers 5.24's names (``DeepseekV4CSACompressor``,
``DeepseekV4HCACompressor``: ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``,
``indexer``).

``compressed = RoPE(RMSNorm(pool(kv_proj(x), gate_proj(x) + position_bias)))`` with the pooling
of :func:`jax_dsa.models.deepseek_v4.compression_layout.pool` and RoPE
(``compress_rope_parameters``, last ``qk_rope_head_dim`` dims, interleaved) at each entry's window
start. Each compressed row is a K = V row of ``head_dim`` like the raw per-token rows it is
concatenated with.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.compression_layout import CompressionLayout, pool
from jax_dsa.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from jax_dsa.models.deepseek_v4.indexer import V4Indexer
from jax_dsa.models.deepseek_v4.rope import apply_rope_tail
from jax_dsa.nn.layers import Linear, RMSNorm, param
from jax_dsa.nn.rope import rope_cos_sin


class V4Compressor(nnx.Module):
    """Compressor of one CSA or HCA layer.

    Args:
      config: the model's :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`.
      layer_type: ``"compressed_sparse_attention"`` (overlapping windows, ratio
        ``compress_rate_csa``, owns a :class:`~jax_dsa.models.deepseek_v4.indexer.V4Indexer`) or
        ``"heavily_compressed_attention"`` (ratio ``compress_rate_hca``, no indexer).

    Parameters: ``kv_proj`` / ``gate_proj [W, hidden]`` and ``position_bias [ratio, W]``
    (float32, zeros at init) with ``W = 2 * head_dim`` for CSA and ``head_dim`` for HCA;
    ``kv_norm [head_dim]``; ``indexer`` (CSA only).

    Raises:
      ValueError: a layer type without compression.
    """

    def __init__(
        self, config: DeepseekV4Config, layer_type: str, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        if layer_type not in (CSA, HCA):
            raise ValueError(
                f"V4Compressor: layer_type must be {CSA!r} or {HCA!r}, got {layer_type!r}"
            )
        c = config
        self.config = config
        self.layer_type = layer_type
        self.ratio = c.compress_rates[layer_type]
        self.overlap = layer_type == CSA
        width = (2 if self.overlap else 1) * c.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=c.initializer_range)
        self.kv_proj = Linear(c.hidden_size, width, axes=("kv_lora", "embed"), **kw)
        self.gate_proj = Linear(c.hidden_size, width, axes=("kv_lora", "embed"), **kw)
        self.position_bias = param(
            rngs, nnx.initializers.zeros, (self.ratio, width), jnp.float32,
            ("compress_slot", "kv_lora"),
        )
        self.kv_norm = RMSNorm(
            c.head_dim, eps=c.rms_norm_eps, axes=("kv_lora",), rngs=rngs, param_dtype=param_dtype
        )
        self.indexer = (
            V4Indexer(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if self.overlap else None
        )

    def __call__(self, x, layout: CompressionLayout):
        """``x [B, S, hidden]`` -> compressed rows ``[B, C, head_dim]`` (compute dtype; zero on
        unused rows) for ``layout`` (ratio :attr:`ratio`)."""
        c = self.config
        if layout.ratio != self.ratio:
            raise ValueError(f"V4Compressor: layout ratio {layout.ratio} != {self.ratio}")
        pooled = pool(
            self.kv_proj(x), self.gate_proj(x), self.position_bias[...], layout,
            overlap=self.overlap,
        )
        cos, sin = rope_cos_sin(layout.window_start, c.compress_rope_parameters, c.qk_rope_head_dim)
        out = apply_rope_tail(self.kv_norm(pooled), cos, sin)
        return jnp.where(layout.valid[..., None], out, 0).astype(pooled.dtype)
