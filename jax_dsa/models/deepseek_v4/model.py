"""DeepSeek V4 as a whole decoder-only language model (transformers ``DeepseekV4ForCausalLM``).

Structure and parameter names follow transformers 5.24 ``DeepseekV4ForCausalLM`` (``embed_tokens``,
``layers.N.{attn_hc, input_layernorm, self_attn, ffn_hc, post_attention_layernorm, mlp}``,
``hc_head``, ``norm``, ``lm_head``; the ``model.`` prefix of its state dict dropped) and the
DeepSeek-V4 report §2::

    X   = [embed(ids)] * hc_mult                                   residual streams [B, S, n, D]
    per layer:
      X = attn_hc.expand(self_attn(input_layernorm(attn_hc(X))), X)      (mHC, :mod:`hyper`)
      X = ffn_hc.expand(mlp(post_attention_layernorm(ffn_hc(X)), ids), X)
    logits = lm_head(norm(hc_head(X)))

Each layer's attention type (window only, CSA, HCA) comes from ``config.layer_types``
(:class:`~jax_dsa.models.deepseek_v4.attention.DeepseekV4Attention`), its MoE routing (top-k or
hash) from ``config.mlp_layer_types`` (:class:`~jax_dsa.models.deepseek_v4.moe.DeepseekV4MoE`). The
hyper-connections, the norms and the routers keep float32 parameters whatever ``param_dtype`` is
(transformers' ``_keep_in_fp32_modules_strict``). The multi-token-prediction layers (``mtp=True``:
``config.num_nextn_predict_layers`` depths, :mod:`jax_dsa.models.deepseek_v4.mtp`) are an option,
off by default: transformers does not build them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.attention import ATTENTION_MODES
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.decoder import STREAM_AXES, DeepseekV4DecoderLayer
from jax_dsa.models.deepseek_v4.hyper import HyperHead
from jax_dsa.models.deepseek_v4.mtp import DeepseekV4MTPLayer, shift_ids
from jax_dsa.nn.checks import check_lm_inputs
from jax_dsa.nn.layers import Embed, Linear, RMSNorm
from jax_dsa.sharding import constrain


class DeepseekV4LanguageModel(nnx.Module):
    """DeepSeek V4 decoder-only LM (transformers ``DeepseekV4ForCausalLM``): embeddings,
    ``num_hidden_layers`` :class:`DeepseekV4DecoderLayer` blocks on ``hc_mult`` streams, the hyper
    head, the final RMSNorm and the LM head. Same call signature as
    :class:`jax_dsa.nn.DSALanguageModel`.

    Args:
      config: a :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config` (e.g.
        ``get_config("deepseek-v4-tiny")``).
      rngs: parameter RNG.
      dtype: compute dtype; ``param_dtype``: storage dtype of the projections, experts, embedding
        and LM head (hyper-connections, norms, routers, sinks and position biases stay float32).
      mtp: also build ``config.num_nextn_predict_layers`` multi-token-prediction depths
        (``self.mtp``, created after every other parameter, so the rest draws the same values);
        the call then returns their logits in ``aux["mtp_logits"]``.

    Raises:
      ValueError: ``mtp`` with ``num_nextn_predict_layers == 0``.
    """

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32, mtp: bool = False,
    ):
        c = config
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embed(
            c.vocab_size, c.hidden_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
            init_std=c.initializer_range,
        )
        self.layers = nnx.List([
            DeepseekV4DecoderLayer(c, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            for i in range(c.num_hidden_layers)
        ])
        self.hc_head = HyperHead(c, rngs=rngs)
        self.norm = RMSNorm(
            c.hidden_size, eps=c.rms_norm_eps, axes=("embed",), rngs=rngs,
            param_dtype=jnp.float32,
        )
        self.lm_head = Linear(
            c.hidden_size, c.vocab_size, axes=("vocab", "embed"), rngs=rngs, dtype=dtype,
            param_dtype=param_dtype, init_std=c.initializer_range,
        )
        if mtp and c.num_nextn_predict_layers < 1:
            raise ValueError(
                "DeepseekV4LanguageModel: mtp=True needs num_nextn_predict_layers >= 1")
        self.mtp = nnx.List([
            DeepseekV4MTPLayer(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            for _ in range(c.num_nextn_predict_layers)
        ]) if mtp else None

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
        """Next-token logits and the CSA indexer loss.

        Args:
          input_ids: ``[B, S]`` int token ids in ``[0, vocab_size)`` (they also route the
            ``"hash_moe"`` layers).
          positions: ``[B, S]`` positions counting from 0 within each document (default
            ``arange(S)``); see :meth:`DeepseekV4Attention.__call__` for packing.
          segment_ids: optional ``[B, S]`` document ids of packed rows.
          attention_mode: ``"sparse"`` (CSA layers use the indexer's top-k) or ``"dense"`` (CSA
            layers attend to every visible compressed entry: the indexer's warm-up).
          implementation: passed to every DSA op of every layer and to the MoE layers' grouped
            matmuls (``None``: each op's default order).
          compute_indexer_loss: compute the CSA layers' indexer KL losses.
          deterministic: passed to every DSA op of every layer (``True``: bitwise reproducible
            gradients of the DSA ops; ``None``: XLA's ``--xla_gpu_deterministic_ops`` decides,
            which also makes XLA's own scatters, e.g. the embedding's and the experts'
            gradients, deterministic: set it for a bitwise reproducible training step).
          return_indices: also return each layer's slot lists (``aux["indices"]``) and lengths
            (``aux["topk_length"]``).

        Returns:
          ``(logits [B, S, vocab_size] float32, aux)``; ``aux["indexer_loss"]`` is the float32 mean
          of the CSA layers' KL losses (0 when none is computed). Its gradients reach only the
          indexers' parameters; the logits' gradients never do. With MTP layers,
          ``aux["mtp_logits"]`` is a tuple of ``[B, S, vocab_size]`` float32, depth ``k``'s row
          ``i`` predicting token ``i + k + 1`` (no target for the last ``k + 1`` positions).
          ``aux["expert_load"]``: a tuple with one ``[n_routed_experts]`` int32 per MoE block
          (every layer, then each MTP depth): the tokens each expert received, for
          :func:`jax_dsa.nn.experts.update_router_biases` (matching
          :func:`jax_dsa.nn.experts.moe_blocks`). ``aux["expert_overflow"]``: one int32 scalar
          per MoE block, the pairs a capped expert-parallel buffer dropped (0 unless
          ``capacity_factor`` is set: :func:`jax_dsa.nn.experts.set_expert_dispatch`).

        Raises:
          ValueError: ``input_ids`` not ``[B, S]``, bad positions / segment ids, unknown mode.
          TypeError: non-integer ``input_ids``.
        """
        c = self.config
        input_ids, positions, segment_ids = check_lm_inputs(
            input_ids, positions, segment_ids, attention_mode, ATTENTION_MODES
        )
        x = constrain(self.embed_tokens(input_ids), ("batch", "sequence", "embed"))
        streams = constrain(
            jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], c.hc_mult, x.shape[-1])),
            STREAM_AXES)
        losses, all_indices, all_lengths, loads, overflows = [], [], [], [], []
        for layer in self.layers:
            streams, aux = layer(
                streams, input_ids, positions, segment_ids, attention_mode=attention_mode,
                implementation=implementation, compute_indexer_loss=compute_indexer_loss,
                deterministic=deterministic,
            )
            if aux["indexer_loss"] is not None:
                losses.append(aux["indexer_loss"])
            all_indices.append(aux["indices"])
            all_lengths.append(aux["topk_length"])
            loads.append(aux["expert_load"])
            overflows.append(aux["expert_overflow"])
        x = constrain(self.norm(self.hc_head(streams)), ("batch", "sequence", "embed"))
        logits = constrain(self.lm_head(x).astype(jnp.float32), ("batch", "sequence", "vocab"))
        mtp_logits = []
        for k, layer in enumerate(self.mtp or (), start=1):
            ids_k = constrain(shift_ids(input_ids, k), ("batch", "sequence"))
            streams, h, aux = layer.predict(
                streams, self.embed_tokens(ids_k), ids_k, positions, segment_ids,
                attention_mode=attention_mode, implementation=implementation,
                compute_indexer_loss=compute_indexer_loss, deterministic=deterministic,
            )
            mtp_logits.append(constrain(self.lm_head(h).astype(jnp.float32),
                                        ("batch", "sequence", "vocab")))
            loads.append(aux["expert_load"])
            overflows.append(aux["expert_overflow"])
        indexer_loss = jnp.mean(jnp.stack(losses)) if losses else jnp.zeros((), jnp.float32)
        out_aux = {"indexer_loss": indexer_loss, "expert_load": tuple(loads),
                   "expert_overflow": tuple(overflows)}
        if self.mtp is not None:
            out_aux["mtp_logits"] = tuple(mtp_logits)
        if return_indices:
            out_aux["indices"] = tuple(all_indices)
            out_aux["topk_length"] = tuple(all_lengths)
        return logits, out_aux


__all__ = ["DeepseekV4DecoderLayer", "DeepseekV4LanguageModel", "STREAM_AXES"]
