"""The CSA lightning indexer of DeepSeek V4: its own compressor at ``index_head_dim``, queries
from the q latent, per-head weights, ReLU scores and top-k over the visible compressed entries.

Math and parameter names: transformers 5.24 ``DeepseekV4Indexer`` / ``DeepseekV4IndexerScorer``
(``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``, ``q_b_proj``,
``scorer.weights_proj``) and the DeepSeek-V4 report §2.3.1 (eqs. 13-17)::

    k_s      = RoPE(RMSNorm(pool_CSA(kv_proj(x), gate_proj(x))))       (window start position)
    q_{t,h}  = RoPE(q_b_proj(c_q)_h)                                    (query position)
    w_{t,h}  = weights_proj(x)_h * index_n_heads**-0.5 * index_head_dim**-0.5
    I[t, s]  = sum_h w_{t,h} * relu(q_{t,h} . k_s)

over the compressed entries ``s`` visible to ``t``
(:mod:`jax_dsa.models.deepseek_v4.compression_layout`), with the compressed layers' RoPE
(``compress_rope_parameters``) on the last ``qk_rope_head_dim`` dims. The inference path's Hadamard
rotation and FP4 quantization are not applied (the rotation keeps dot products; the quantization is
an inference precision choice).

The inputs ``x`` and ``c_q`` are wrapped in ``stop_gradient``: the indexer learns only from its
KL loss (:func:`jax_dsa.ops.indexer.v4_indexer_kl_loss`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.compression_layout import CompressionLayout, pool, query_segments
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.rope import apply_rope_tail
from jax_dsa.nn.layers import Linear, RMSNorm, param
from jax_dsa.nn.rope import rope_cos_sin
from jax_dsa.ops.indexer import TOPK_REGISTRY, indexer_topk
from jax_dsa.sharding.constraints import check_split


class V4IndexerScorer(nnx.Module):
    """Holds ``weights_proj [index_n_heads, hidden_size]`` (float32), as transformers names it."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        self.weights_proj = Linear(
            c.hidden_size, c.index_n_heads, axes=("index_heads", "embed"), rngs=rngs,
            dtype=jnp.float32, param_dtype=jnp.float32, init_std=c.initializer_range,
        )


class V4Indexer(nnx.Module):
    """The CSA indexer of one compressed-sparse-attention layer.

    Parameters (PyTorch ``[out, in]`` layout): ``kv_proj`` / ``gate_proj [2 * index_head_dim,
    hidden]``, ``position_bias [compress_rate_csa, 2 * index_head_dim]`` (float32, zeros at
    init), ``kv_norm [index_head_dim]``, ``q_b_proj [index_n_heads * index_head_dim,
    q_lora_rank]``, ``scorer.weights_proj [index_n_heads, hidden]``.
    """

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        self.config = config
        self.dtype = dtype
        d = c.index_head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=c.initializer_range)
        self.kv_proj = Linear(c.hidden_size, 2 * d, axes=("index_head_dim", "embed"), **kw)
        self.gate_proj = Linear(c.hidden_size, 2 * d, axes=("index_head_dim", "embed"), **kw)
        self.position_bias = param(
            rngs, nnx.initializers.zeros, (c.compress_rate_csa, 2 * d), jnp.float32,
            ("compress_slot", "index_head_dim"),
        )
        self.kv_norm = RMSNorm(
            d, eps=c.rms_norm_eps, axes=("index_head_dim",), rngs=rngs, param_dtype=param_dtype
        )
        self.q_b_proj = Linear(
            c.q_lora_rank, c.index_n_heads * d, axes=("index_heads", "q_lora"), **kw
        )
        self.scorer = V4IndexerScorer(c, rngs=rngs)

    def __call__(self, x, c_q, positions, layout: CompressionLayout):
        """Indexer queries, compressed keys and head weights.

        Args:
          x: ``[B, S, hidden_size]`` layer input.
          c_q: ``[B, S, q_lora_rank]`` the layer's normalised q latent (``q_a_norm`` output).
          positions: ``[B, S]`` per-document positions.
          layout: the layer's
            :class:`~jax_dsa.models.deepseek_v4.compression_layout.CompressionLayout` (ratio
            ``compress_rate_csa``).

        Returns:
          ``q [B, S, index_n_heads, index_head_dim]``, ``k [B, C, index_head_dim]`` (compute
          dtype; zero on unused compressed rows) and ``weights [B, S, index_n_heads]`` float32
          with the scale folded in.
        """
        c = self.config
        check_split(c.index_n_heads, "index_heads", "index_n_heads")
        x = jax.lax.stop_gradient(x)
        c_q = jax.lax.stop_gradient(c_q)
        b, s = x.shape[:2]
        rope, r = c.compress_rope_parameters, c.qk_rope_head_dim
        pooled = pool(
            self.kv_proj(x), self.gate_proj(x), self.position_bias[...], layout, overlap=True
        )
        cos_k, sin_k = rope_cos_sin(layout.window_start, rope, r)
        k = apply_rope_tail(self.kv_norm(pooled), cos_k, sin_k)
        k = jnp.where(layout.valid[..., None], k, 0)
        cos_q, sin_q = rope_cos_sin(positions, rope, r)
        q = self.q_b_proj(c_q).reshape(b, s, c.index_n_heads, c.index_head_dim)
        q = apply_rope_tail(q, cos_q[:, :, None], sin_q[:, :, None])
        weights = self.scorer.weights_proj(x.astype(jnp.float32)) * c.indexer_weight_scale
        return q, k, weights

    def topk(self, q, k, weights, positions, layout: CompressionLayout, segment_ids=None, *,
             implementation=None):
        """Top ``min(index_topk, C)`` visible compressed entries per query: ``[B, S, K]`` int32
        indices into the compressed rows, ``-1`` padded at the end (see
        :func:`jax_dsa.ops.indexer.indexer_topk` for ordering and ties). ``implementation``: the
        layer's choice, restricted to the names ``indexer_topk`` has."""
        topk = min(self.config.index_topk, k.shape[-2])
        return indexer_topk(
            q, k, weights, topk=topk, q_positions=positions, kv_positions=layout.positions,
            q_segment_ids=query_segments(positions, segment_ids),
            kv_segment_ids=layout.segment_ids,
            implementation=TOPK_REGISTRY.restrict(implementation),
        )
