"""DeepSeek V4's multi-token-prediction (MTP) layers, an option of
:class:`jax_dsa.models.deepseek_v4.model.DeepseekV4LanguageModel` (off by default; transformers 5.24
builds no MTP and skips the release's ``mtp.*`` tensors; :func:`jax_dsa.interop.load_hf` reads them
and :func:`jax_dsa.interop.save_hf` writes them,
:mod:`jax_dsa.models.deepseek_v4.checkpoint_layouts`).

Math: the DeepSeek-V3 report §2.2 (sequential MTP modules sharing the embedding and the output
head) in the V4 form of DeepSeek's release (``MTPBlock``: parameters ``e_proj``, ``h_proj``,
``enorm``, ``hnorm``, ``norm``, ``hc_head_{fn,base,scale}`` and a whole V4 block). Depth ``k``
takes the streams ``X^{k-1}`` (``X^0``: the main model's last streams, before its hyper head) and
the embeddings of the tokens ``k`` places ahead::

    X^k      = Block_k(h_proj(hnorm(X^{k-1})) + e_proj(enorm(embed(t_{i+k}))))   (every stream)
    logits^k = lm_head(norm_k(hc_head_k(X^k)))          predicts t_{i+k+1} at position i

``Block_k`` is a V4 decoder layer with window-only attention (the release's ``compress_ratios``
entry of the MTP layer is 0) and top-k MoE. Its attention sees the same positions as the main
model's; the last ``k`` positions of a row (and those whose ``i + k`` lies in another packed
document) have no target and should be masked by the caller's loss.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from jax_dsa.models.deepseek_v4.decoder import DeepseekV4DecoderLayer
from jax_dsa.models.deepseek_v4.hyper import HyperHead
from jax_dsa.nn.layers import Linear, RMSNorm


def mtp_block_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """The one-layer config an MTP block is built from: window-only attention, top-k MoE."""
    return dataclasses.replace(config, num_hidden_layers=1, layer_types=(SLIDING,),
                               mlp_layer_types=("moe",))


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """One MTP depth: a :class:`~jax_dsa.models.deepseek_v4.decoder.DeepseekV4DecoderLayer` (its
    ``attn_hc``, ``self_attn``, ``ffn_hc``, ``mlp``, norms) plus ``e_proj`` / ``h_proj``
    ``[hidden, hidden]``, ``enorm`` / ``hnorm`` / ``norm`` (float32) and ``hc_head`` (a
    :class:`~jax_dsa.models.deepseek_v4.hyper.HyperHead`).

    Args:
      config: the model's config; rngs, dtype, param_dtype: as for the decoder layers.
    """

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        super().__init__(mtp_block_config(c), 0, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=c.initializer_range)
        norm_kw = dict(eps=c.rms_norm_eps, axes=("embed",), rngs=rngs, param_dtype=jnp.float32)
        self.e_proj = Linear(c.hidden_size, c.hidden_size, axes=("embed", "embed"), **kw)
        self.h_proj = Linear(c.hidden_size, c.hidden_size, axes=("embed", "embed"), **kw)
        self.enorm = RMSNorm(c.hidden_size, **norm_kw)
        self.hnorm = RMSNorm(c.hidden_size, **norm_kw)
        self.norm = RMSNorm(c.hidden_size, **norm_kw)
        self.hc_head = HyperHead(c, rngs=rngs)

    def predict(self, streams, embeds, input_ids, positions, segment_ids, **attn_kwargs):
        """One depth.

        Args:
          streams: ``[B, S, hc_mult, hidden]`` (the previous depth's, or the main model's last).
          embeds: ``[B, S, hidden]`` embeddings of ``input_ids``, the tokens ``k`` places ahead.
          input_ids, positions, segment_ids, attn_kwargs: as for the decoder layers.

        Returns:
          ``(streams [B, S, hc_mult, hidden], hidden [B, S, hidden] for the LM head, attention
          aux)``.
        """
        e = self.e_proj(self.enorm(embeds))
        x = self.h_proj(self.hnorm(streams)) + e[:, :, None, :].astype(streams.dtype)
        x, aux = self(x.astype(streams.dtype), input_ids, positions, segment_ids, **attn_kwargs)
        return x, self.norm(self.hc_head(x)), aux


def shift_ids(input_ids, k: int):
    """``input_ids`` moved ``k`` places left, the last ``k`` filled with 0: ``[B, S]``."""
    if k <= 0:
        raise ValueError(f"shift_ids: k must be >= 1, got {k}")
    k = min(k, input_ids.shape[1])
    pad = jnp.zeros((input_ids.shape[0], k), input_ids.dtype)
    return jnp.concatenate([input_ids[:, k:], pad], axis=1)


__all__ = ["DeepseekV4MTPLayer", "mtp_block_config", "shift_ids"]
