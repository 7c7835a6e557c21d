"""A small decoder-only language model with DeepSeek V4 attention (pre-norm blocks, SwiGLU MLP).

Names follow transformers' ``DeepseekV4ForCausalLM`` (``embed_tokens``,
``layers.N.input_layernorm``, ``layers.N.self_attn``, ``layers.N.post_attention_layernorm``,
``layers.N.mlp``, ``norm``, ``lm_head``), but the blocks are standard residual blocks with a dense
SwiGLU MLP: V4's hyper-connections (mHC), MoE and MTP are not built. Each layer's attention type
(window only, CSA, HCA) comes from ``config.layer_types``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.configs.v4 import DeepseekV4Config
from jax_dsa.nn.layers import RMSNorm
from jax_dsa.nn.mlp import MLP
from jax_dsa.nn.model import check_lm_inputs, init_decoder
from jax_dsa.nn.v4_attention import ATTENTION_MODES, DeepseekV4Attention
from jax_dsa.sharding import constrain


class DeepseekV4DecoderLayer(nnx.Module):
    """``h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``."""

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        norm_kw = dict(eps=c.rms_norm_eps, axes=("embed",), rngs=rngs, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        self.self_attn = DeepseekV4Attention(
            c, layer_idx, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        self.mlp = MLP(
            c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
            init_std=c.initializer_range,
        )

    def __call__(self, x, positions, segment_ids, **attn_kwargs):
        """``x [B, S, hidden]`` -> ``(x, attention aux)``; keyword arguments as in
        :meth:`jax_dsa.nn.v4_attention.DeepseekV4Attention.__call__`."""
        a, aux = self.self_attn(self.input_layernorm(x), positions, segment_ids, **attn_kwargs)
        x = x + a.astype(x.dtype)
        x = x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype)
        return x, aux


class DeepseekV4LanguageModel(nnx.Module):
    """Decoder-only LM with DeepSeek V4 attention: embeddings, ``num_hidden_layers`` blocks, final
    RMSNorm, LM head. Same call signature as :class:`jax_dsa.nn.DSALanguageModel`.

    Args:
      config: a :class:`~jax_dsa.configs.v4.DeepseekV4Config` (e.g.
        ``get_config("deepseek-v4-tiny")``).
      rngs: parameter RNG.
      dtype: compute dtype; ``param_dtype``: storage dtype of the parameters.
    """

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        init_decoder(
            self, config, DeepseekV4DecoderLayer, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(
        self,
        input_ids,
        positions=None,
        segment_ids=None,
        *,
        attention_mode: str = "sparse",
        implementation: str | tuple[str, ...] | None = None,
        compute_indexer_loss: bool = True,
        return_indices: bool = False,
    ):
        """Next-token logits and the CSA indexer loss.

        Args:
          input_ids: ``[B, S]`` int token ids in ``[0, vocab_size)``.
          positions: ``[B, S]`` positions counting from 0 within each document (default
            ``arange(S)``); see :meth:`DeepseekV4Attention.__call__` for packing.
          segment_ids: optional ``[B, S]`` document ids of packed rows.
          attention_mode: ``"sparse"`` (CSA layers use the indexer's top-k) or ``"dense"`` (CSA
            layers attend to every visible compressed entry: the indexer's warm-up).
          implementation: passed to every DSA op of every layer (``None``: each op's default order).
          compute_indexer_loss: compute the CSA layers' indexer KL losses.
          return_indices: also return each layer's slot lists (``aux["indices"]``) and lengths
            (``aux["topk_length"]``).

        Returns:
          ``(logits [B, S, vocab_size] float32, aux)``; ``aux["indexer_loss"]`` is the float32 mean
          of the CSA layers' KL losses (0 when none is computed). Its gradients reach only the
          indexers' parameters; the logits' gradients never do.

        Raises:
          ValueError: ``input_ids`` not ``[B, S]``, bad positions / segment ids, unknown mode.
          TypeError: non-integer ``input_ids``.
        """
        input_ids, positions, segment_ids = check_lm_inputs(
            input_ids, positions, segment_ids, attention_mode, ATTENTION_MODES
        )
        x = constrain(self.embed_tokens(input_ids), ("batch", "sequence", "embed"))
        losses, all_indices, all_lengths = [], [], []
        for layer in self.layers:
            x, aux = layer(
                x, positions, segment_ids, attention_mode=attention_mode,
                implementation=implementation, compute_indexer_loss=compute_indexer_loss,
            )
            x = constrain(x, ("batch", "sequence", "embed"))
            if aux["indexer_loss"] is not None:
                losses.append(aux["indexer_loss"])
            all_indices.append(aux["indices"])
            all_lengths.append(aux["topk_length"])
        logits = constrain(self.lm_head(self.norm(x)).astype(jnp.float32),
                           ("batch", "sequence", "vocab"))
        indexer_loss = jnp.mean(jnp.stack(losses)) if losses else jnp.zeros((), jnp.float32)
        out_aux = {"indexer_loss": indexer_loss}
        if return_indices:
            out_aux["indices"] = tuple(all_indices)
            out_aux["topk_length"] = tuple(all_lengths)
        return logits, out_aux
