"""Hugging Face ``config.json`` <-> :class:`~jax_dsa.models.glm.config.DSAConfig` (GLM-5 /
GLM-5.2 / DeepSeek V3.2), as transformers reads it. :mod:`jax_dsa.interop.hf_config` dispatches
here by ``model_type`` (``"glm_moe_dsa"``, ``"deepseek_v32"``).

The reference is transformers' ``GlmMoeDsaConfig`` / ``DeepseekV32Config`` and the modeling code
that consumes them (transformers 5.24, ``models/glm_moe_dsa``, ``models/deepseek_v32``). Where the
modeling code ignores a key, so does this mapping, with a warning when the key disagrees:

* MLA RoPE is always interleaved (``apply_rotary_pos_emb_interleave``), whatever
  ``rope_interleave`` says.
* The indexer RoPE is interleaved for ``glm_moe_dsa`` and half-split for ``deepseek_v32``,
  whatever ``indexer_rope_interleave`` says.
* ``deepseek_v32`` runs its own indexer on every layer: IndexShare (``indexer_types``,
  ``index_topk_freq``, ...) exists only for ``glm_moe_dsa``.
* YaRN without ``factor`` uses ``max_position_embeddings / original_max_position_embeddings``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.nn.rope_parameters import RopeParameters

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
INDEXER_ROPE_INTERLEAVE = {"glm_moe_dsa": True, "deepseek_v32": False}
# Warnings point at the caller's line, past the dispatchers (config_from_hf, load_hf).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Quantisation read by the loader (block-scaled FP8 weights with ``weight_scale_inv``).
SUPPORTED_QUANT_METHODS = ("fp8",)

# DSAConfig fields written to config.json as they are (HF names).
_PLAIN_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
    "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "attention_bias", "index_topk", "index_head_dim", "index_n_heads",
    "first_k_dense_replace", "scoring_func", "topk_method",
)


def config_from_hf(d: Mapping[str, Any]) -> DSAConfig:
    """The config that means what transformers' model of ``d`` computes.

    Args:
      d: a ``config.json`` dict with ``model_type`` in :data:`MODEL_TYPES`.

    Returns:
      A :class:`DSAConfig` with every DSA, RoPE (YaRN and its mscale), MoE and IndexShare field.

    Raises:
      ValueError: another ``model_type``, a RoPE type other than ``default`` / ``yarn``, a
        ``partial_rotary_factor`` other than 1, an unsupported quantisation method, or any of
        the config class's own checks.
    """
    d = dict(d)
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config_from_hf: model_type must be one of {MODEL_TYPES}, got {model_type!r}"
        )
    quant = d.get("quantization_config")
    if quant and quant.get("quant_method") not in SUPPORTED_QUANT_METHODS:
        raise ValueError(
            f"config_from_hf: quantization_config.quant_method {quant.get('quant_method')!r} is "
            f"not supported (supported: {SUPPORTED_QUANT_METHODS})"
        )
    if d.get("rope_interleave") is False:
        warnings.warn(
            "config_from_hf: rope_interleave=false is ignored: transformers always applies "
            "interleaved RoPE in MLA for these models", skip_file_prefixes=(_PACKAGE,),
        )
    d["rope_interleave"] = True
    want = INDEXER_ROPE_INTERLEAVE[model_type]
    if d.get("indexer_rope_interleave") is not None and bool(d["indexer_rope_interleave"]) != want:
        warnings.warn(
            f"config_from_hf: indexer_rope_interleave={d['indexer_rope_interleave']} is ignored: "
            f"transformers' {model_type} indexer {'interleaves' if want else 'half-splits'} its "
            "RoPE", skip_file_prefixes=(_PACKAGE,),
        )
    d["indexer_rope_interleave"] = want
    if model_type == "deepseek_v32":
        types = d.get("indexer_types")
        if types is not None and any(t != "full" for t in types):
            warnings.warn(
                "config_from_hf: deepseek_v32 ignores indexer_types (every layer runs its "
                "indexer in transformers)", skip_file_prefixes=(_PACKAGE,),
            )
        for key in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
            d.pop(key, None)
        d["indexer_types"] = ["full"] * int(d.get("num_hidden_layers", DSAConfig.num_hidden_layers))
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"config_from_hf: partial_rotary_factor={rope['partial_rotary_factor']} is not "
            "supported (the MLA RoPE spans qk_rope_head_dim)"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn" and rope.get("factor") is None:
        orig = rope.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        rope["factor"] = d["max_position_embeddings"] / orig
    if rope:
        d["rope_parameters"] = rope
        d.pop("rope_scaling", None)
    return DSAConfig.from_hf_dict(d)


def _rope_to_hf(p: RopeParameters) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": p.rope_type, "rope_theta": p.rope_theta}
    if p.rope_type == "yarn":
        out.update(
            factor=p.factor, original_max_position_embeddings=p.original_max_position_embeddings,
            beta_fast=p.beta_fast, beta_slow=p.beta_slow,
        )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(p, name) is not None:
                out[name] = getattr(p, name)
        if not p.truncate:
            out["truncate"] = False
    return out


def config_to_hf(config: DSAConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """A ``config.json`` dict that transformers reads back as the same model.

    ``num_nextn_predict_layers`` is written as 0; ``mlp_layer_types=None`` (every layer dense)
    is written out explicitly.

    Args:
      config: the model's :class:`DSAConfig`.
      dtype: optional ``"float32"`` / ``"bfloat16"`` ... for the ``dtype`` key.

    Raises:
      ValueError: what transformers cannot represent: another ``model_type``, shared indexer
        layers on ``deepseek_v32``, non-interleaved MLA RoPE, or an indexer RoPE layout other
        than the model type's.
    """
    c = config
    if c.model_type not in MODEL_TYPES:
        raise ValueError(
            f"config_to_hf: model_type must be one of {MODEL_TYPES}, got {c.model_type!r}"
        )
    if not c.rope_interleave:
        raise ValueError(
            "config_to_hf: transformers' MLA RoPE is interleaved; rope_interleave=False cannot be "
            "saved for it"
        )
    if c.indexer_rope_interleave != INDEXER_ROPE_INTERLEAVE[c.model_type]:
        raise ValueError(
            f"config_to_hf: transformers' {c.model_type} indexer uses indexer_rope_interleave="
            f"{INDEXER_ROPE_INTERLEAVE[c.model_type]}, the config has {c.indexer_rope_interleave}"
        )
    if c.model_type == "deepseek_v32" and c.shared_indexer_layers:
        raise ValueError(
            f"config_to_hf: deepseek_v32 has no shared indexer layers in transformers; layers "
            f"{c.shared_indexer_layers} are 'shared' (use model_type='glm_moe_dsa')"
        )
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
    }
    out.update({name: getattr(c, name) for name in _PLAIN_FIELDS})
    out["rope_parameters"] = _rope_to_hf(c.rope_parameters)
    out["mlp_layer_types"] = list(c.mlp_layer_types or ("dense",) * c.num_hidden_layers)
    out["num_nextn_predict_layers"] = 0
    out["rope_interleave"] = True
    out["indexer_rope_interleave"] = c.indexer_rope_interleave
    if c.model_type == "glm_moe_dsa":
        out["indexer_types"] = list(c.indexer_types)
        out["index_topk_freq"] = c.index_topk_freq
        out["index_skip_topk_offset"] = c.index_skip_topk_offset
    if dtype is not None:
        out["dtype"] = dtype
    return out


__all__ = ["ARCHITECTURES", "MODEL_TYPES", "config_from_hf", "config_to_hf"]
