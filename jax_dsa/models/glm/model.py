"""A small decoder-only language model with DSA attention (pre-norm blocks, SwiGLU MLP).

Structure and parameter names follow transformers' ``GlmMoeDsaForCausalLM`` /
``DeepseekV32ForCausalLM`` (``embed_tokens``, ``layers.N.input_layernorm``,
``layers.N.self_attn``, ``layers.N.post_attention_layernorm``, ``layers.N.mlp``, ``norm``,
``lm_head``). ``layers.N.mlp`` is the MoE block (:mod:`jax_dsa.models.glm.moe`) where
``config.mlp_layer_types`` says ``"sparse"``, else a dense SwiGLU MLP. There is no MTP head.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.glm.attention import ATTENTION_MODES, DSAAttention
from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.models.glm.moe import MoE
from jax_dsa.nn.checks import check_lm_inputs
from jax_dsa.nn.layers import Embed, Linear, RMSNorm
from jax_dsa.nn.mlp import MLP
from jax_dsa.sharding import constrain


def init_decoder(module, config, layer_cls, *, rngs, dtype, param_dtype):
    """Gives a decoder-only LM its parts: ``embed_tokens``, ``layers`` (``layer_cls(config, i)``
    for each layer), the final ``norm`` and ``lm_head``."""
    c = config
    module.config = config
    module.dtype = dtype
    module.embed_tokens = Embed(
        c.vocab_size, c.hidden_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
        init_std=c.initializer_range,
    )
    module.layers = nnx.List([
        layer_cls(c, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        for i in range(c.num_hidden_layers)
    ])
    module.norm = RMSNorm(
        c.hidden_size, eps=c.rms_norm_eps, axes=("embed",), rngs=rngs, param_dtype=param_dtype
    )
    module.lm_head = Linear(
        c.hidden_size, c.vocab_size, axes=("vocab", "embed"), rngs=rngs, dtype=dtype,
        param_dtype=param_dtype, init_std=c.initializer_range,
    )


class DecoderLayer(nnx.Module):
    """``h = x + self_attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``."""

    def __init__(
        self, config: DSAConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        norm_kw = dict(eps=c.rms_norm_eps, axes=("embed",), rngs=rngs, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        self.self_attn = DSAAttention(
            c, layer_idx, rngs=rngs, dtype=dtype, param_dtype=param_dtype
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm_kw)
        if c.is_moe_layer(layer_idx):
            self.mlp = MoE(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        else:
            self.mlp = MLP(
                c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype,
                param_dtype=param_dtype, init_std=c.initializer_range,
            )

    def __call__(self, x, positions, segment_ids, **attn_kwargs):
        """``x [B, S, hidden]`` -> ``(x [B, S, hidden], aux)``: the attention's aux plus
        ``aux["expert_load"]``, the MoE block's tokens per expert (``[n_routed_experts]``
        int32; ``None`` on a dense layer) and ``aux["expert_overflow"]``, the pairs a capped
        expert-parallel buffer dropped (int32 scalar; ``None`` on a dense layer). See
        :meth:`jax_dsa.models.glm.attention.DSAAttention.__call__` for the keyword arguments;
        ``implementation`` also reaches the experts' grouped matmuls."""
        a, aux = self.self_attn(self.input_layernorm(x), positions, segment_ids, **attn_kwargs)
        x = x + a.astype(x.dtype)
        h = self.post_attention_layernorm(x)
        load = overflow = None
        if isinstance(self.mlp, MoE):
            m, load, overflow = self.mlp(h, implementation=attn_kwargs.get("implementation"),
                                         return_load=True, return_overflow=True)
        else:
            m = self.mlp(h)
        x = x + m.astype(x.dtype)
        return x, {**aux, "expert_load": load, "expert_overflow": overflow}


class DSALanguageModel(nnx.Module):
    """Decoder-only LM: embeddings, ``num_hidden_layers`` DSA blocks, final RMSNorm, LM head.

    Args:
      config: a :class:`~jax_dsa.configs.DSAConfig` (e.g. ``get_config("glm5-tiny")``).
      rngs: parameter RNG (``nnx.Rngs(0)``).
      dtype: compute dtype of activations and matmuls (``float32`` default, ``bfloat16``
        optional); ``param_dtype``: storage dtype of the parameters.
    """

    def __init__(
        self, config: DSAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        init_decoder(self, config, DecoderLayer, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

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
        deterministic: bool | None = None,
    ):
        """Next-token logits and the indexer loss.

        Args:
          input_ids: ``[B, S]`` int32 token ids in ``[0, vocab_size)``.
          positions: ``[B, S]`` integer per-document positions (default ``arange(S)`` per row).
          segment_ids: ``[B, S]`` integer document ids for packed rows (default: one document).
          attention_mode: ``"sparse"`` (indexer top-k; ``"shared"`` layers reuse the previous
            full layer's) or ``"dense"`` (every visible key: the dense warm-up stage).
          implementation: passed to every DSA op of every layer and to the MoE layers' grouped
            matmuls (``None``: each op's default order).
          compute_indexer_loss: compute the per-layer indexer KL losses.
          deterministic: passed to every DSA op of every layer (``True``: bitwise reproducible
            gradients of the DSA ops; ``None``: XLA's ``--xla_gpu_deterministic_ops`` decides,
            which also makes XLA's own scatters, e.g. the embedding's and the experts'
            gradients, deterministic: set it for a bitwise reproducible training step).
          return_indices: also return each layer's slot lists in ``aux["indices"]`` (``None``
            per layer in dense mode, which builds none).

        Returns:
          ``(logits [B, S, vocab_size] float32, aux)``; ``aux["indexer_loss"]`` is the float32
          mean of the KL losses of the layers that own an indexer (0 when not computed). Its
          gradients reach only indexer parameters; the logits' gradients never do.
          ``aux["expert_load"]``: a tuple with one ``[n_routed_experts]`` int32 per MoE layer, in
          layer order (empty for an all-dense model): the tokens each expert received, for
          :func:`jax_dsa.nn.experts.update_router_biases` (matching
          :func:`jax_dsa.nn.experts.moe_blocks`). ``aux["expert_overflow"]``: one int32 scalar
          per MoE layer, the (token, slot) pairs a capped expert-parallel buffer dropped
          (0 unless ``capacity_factor`` is set: :func:`jax_dsa.nn.experts.set_expert_dispatch`).

        Raises:
          ValueError: ``input_ids`` not ``[B, S]``, bad positions / segment ids, unknown mode.
          TypeError: non-integer ``input_ids``.
        """
        c = self.config
        input_ids, positions, segment_ids = check_lm_inputs(
            input_ids, positions, segment_ids, attention_mode, ATTENTION_MODES
        )

        x = constrain(self.embed_tokens(input_ids), ("batch", "sequence", "embed"))
        shared = None
        losses, all_indices, loads, overflows = [], [], [], []
        for i, layer in enumerate(self.layers):
            full = c.has_indexer(i)
            # dense mode: every layer attends to every visible key (dense_mla), no slot list
            indices = None if attention_mode == "dense" or full else shared
            x, aux = layer(
                x, positions, segment_ids, attention_mode=attention_mode, indices=indices,
                implementation=implementation, compute_indexer_loss=compute_indexer_loss,
                deterministic=deterministic,
            )
            x = constrain(x, ("batch", "sequence", "embed"))
            if full:
                shared = aux["indices"]
            if aux["indexer_loss"] is not None:
                losses.append(aux["indexer_loss"])
            all_indices.append(aux["indices"])
            if aux["expert_load"] is not None:
                loads.append(aux["expert_load"])
                overflows.append(aux["expert_overflow"])
        x = self.norm(x)
        logits = constrain(self.lm_head(x).astype(jnp.float32), ("batch", "sequence", "vocab"))
        indexer_loss = jnp.mean(jnp.stack(losses)) if losses else jnp.zeros((), jnp.float32)
        out_aux = {"indexer_loss": indexer_loss, "expert_load": tuple(loads),
                   "expert_overflow": tuple(overflows)}
        if return_indices:
            out_aux["indices"] = tuple(all_indices)
        return logits, out_aux
