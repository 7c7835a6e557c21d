"""Flax NNX layers: the blocks both model families share, and every family's layers by name.

Shared blocks (modules of this package): :mod:`~jax_dsa.nn.layers` (``Linear``, ``Embed``,
``RMSNorm``, ``LayerNorm``, ``LOGICAL_AXES``), :mod:`~jax_dsa.nn.mlp` (the SwiGLU ``MLP``),
:mod:`~jax_dsa.nn.experts` (the stacked routed experts of both MoE blocks),
:mod:`~jax_dsa.nn.rope` and :mod:`~jax_dsa.nn.rope_parameters` (RoPE and its YaRN parameters),
:mod:`~jax_dsa.nn.checks` (the input checks of the attention layers and language models),
:mod:`~jax_dsa.nn.slots` (``dense_indices``).

The model families (:mod:`jax_dsa.models`) build on those blocks; their layers are exported here
too: GLM-5 / GLM-5.2 / DeepSeek V3.2 (:mod:`jax_dsa.models.glm`: ``DSAAttention``, ``Indexer``,
``MoE``, ``DecoderLayer``, ``DSALanguageModel``) and DeepSeek V4
(:mod:`jax_dsa.models.deepseek_v4`: ``DeepseekV4Attention``, ``HyperConnection``, ``HyperHead``,
``DeepseekV4MoE``, ``DeepseekV4DecoderLayer``, ``DeepseekV4MTPLayer``,
``DeepseekV4LanguageModel``).

Every name loads on first use, as :mod:`jax_dsa`'s subpackages do: the families import this
package's modules, so importing the families from here up front would make each wait for the
other.
"""

import importlib

# name -> the module that defines it
_MODULES = {
    "LOGICAL_AXES": "jax_dsa.nn.layers",
    "Embed": "jax_dsa.nn.layers",
    "LayerNorm": "jax_dsa.nn.layers",
    "Linear": "jax_dsa.nn.layers",
    "RMSNorm": "jax_dsa.nn.layers",
    "MLP": "jax_dsa.nn.mlp",
    "apply_rope": "jax_dsa.nn.rope",
    "inv_frequencies": "jax_dsa.nn.rope",
    "rope_cos_sin": "jax_dsa.nn.rope",
    "dense_indices": "jax_dsa.nn.slots",
    "ATTENTION_MODES": "jax_dsa.models.glm.attention",
    "DSAAttention": "jax_dsa.models.glm.attention",
    "Indexer": "jax_dsa.models.glm.indexer",
    "MoE": "jax_dsa.models.glm.moe",
    "DecoderLayer": "jax_dsa.models.glm.model",
    "DSALanguageModel": "jax_dsa.models.glm.model",
    "DeepseekV4Attention": "jax_dsa.models.deepseek_v4.attention",
    "HyperConnection": "jax_dsa.models.deepseek_v4.hyper",
    "HyperHead": "jax_dsa.models.deepseek_v4.hyper",
    "DeepseekV4MoE": "jax_dsa.models.deepseek_v4.moe",
    "DeepseekV4DecoderLayer": "jax_dsa.models.deepseek_v4.decoder",
    "DeepseekV4MTPLayer": "jax_dsa.models.deepseek_v4.mtp",
    "DeepseekV4LanguageModel": "jax_dsa.models.deepseek_v4.model",
}

__all__ = [
    "ATTENTION_MODES",
    "DSAAttention",
    "DSALanguageModel",
    "DecoderLayer",
    "DeepseekV4Attention",
    "DeepseekV4DecoderLayer",
    "DeepseekV4LanguageModel",
    "DeepseekV4MTPLayer",
    "DeepseekV4MoE",
    "Embed",
    "HyperConnection",
    "HyperHead",
    "Indexer",
    "LOGICAL_AXES",
    "LayerNorm",
    "Linear",
    "MLP",
    "MoE",
    "RMSNorm",
    "apply_rope",
    "dense_indices",
    "inv_frequencies",
    "rope_cos_sin",
]


def __getattr__(name):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
