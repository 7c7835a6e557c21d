"""One DeepSeek V4 decoder layer on the ``hc_mult`` residual streams (transformers 5.24
``DeepseekV4DecoderLayer``: ``attn_hc``, ``input_layernorm``, ``self_attn``, ``ffn_hc``,
``post_attention_layernorm``, ``mlp``; DeepSeek-V4 report §2)::

    X = attn_hc.expand(self_attn(input_layernorm(attn_hc(X))), X)
    X = ffn_hc.expand(mlp(post_attention_layernorm(ffn_hc(X)), ids), X)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.attention import DeepseekV4Attention
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.hyper import HyperConnection
from jax_dsa.models.deepseek_v4.moe import DeepseekV4MoE
from jax_dsa.nn.layers import RMSNorm
from jax_dsa.sharding import constrain

STREAM_AXES = ("batch", "sequence", None, "embed")


class DeepseekV4DecoderLayer(nnx.Module):
    """One V4 block on the ``hc_mult`` residual streams: attention, then MoE, each entered and
    left through a :class:`~jax_dsa.models.deepseek_v4.hyper.HyperConnection` (``attn_hc``,
    ``ffn_hc``)."""

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        norm_kw = dict(eps=c.rms_norm_eps, axes=("embed",), rngs=rngs, param_dtype=jnp.float32)
        self.attn_hc = HyperConnection(c, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        self.self_attn = DeepseekV4Attention(
            c, layer_idx, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.ffn_hc = HyperConnection(c, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        self.mlp = DeepseekV4MoE(c, layer_idx, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, streams, input_ids, positions, segment_ids, **attn_kwargs):
        """``streams [B, S, hc_mult, hidden]``, ``input_ids [B, S]`` -> ``(streams, aux)``: the
        attention's aux plus ``aux["expert_load"]``, the MoE block's tokens per expert
        (``[n_routed_experts]`` int32) and ``aux["expert_overflow"]`` (pairs a capped
        expert-parallel buffer dropped, int32 scalar); keyword arguments as in
        :meth:`DeepseekV4Attention.__call__` (``implementation`` also reaches the experts'
        grouped matmuls)."""
        x, post, comb = self.attn_hc(streams)
        a, aux = self.self_attn(self.input_layernorm(x), positions, segment_ids, **attn_kwargs)
        streams = constrain(HyperConnection.expand(a, streams, post, comb), STREAM_AXES)
        x, post, comb = self.ffn_hc(streams)
        m, load, overflow = self.mlp(self.post_attention_layernorm(x), input_ids,
                                     implementation=attn_kwargs.get("implementation"),
                                     return_load=True, return_overflow=True)
        streams = constrain(HyperConnection.expand(m, streams, post, comb), STREAM_AXES)
        return streams, {**aux, "expert_load": load, "expert_overflow": overflow}


__all__ = ["STREAM_AXES", "DeepseekV4DecoderLayer"]
