"""Flax NNX layers for DSA models (GLM-5 / GLM-5.2 / DeepSeek V3.2) and their decoder LM, and
DeepSeek V4 (attention types, hyper-connections, MoE, the whole LM)."""

from jax_dsa.nn.attention import ATTENTION_MODES, DSAAttention
from jax_dsa.nn.indexer import Indexer
from jax_dsa.nn.layers import LOGICAL_AXES, Embed, LayerNorm, Linear, RMSNorm
from jax_dsa.nn.mlp import MLP
from jax_dsa.nn.model import DecoderLayer, DSALanguageModel
from jax_dsa.nn.moe import MoE
from jax_dsa.nn.rope import apply_rope, inv_frequencies, rope_cos_sin
from jax_dsa.nn.slots import dense_indices
from jax_dsa.nn.v4_attention import DeepseekV4Attention
from jax_dsa.nn.v4_hyper import HyperConnection, HyperHead
from jax_dsa.nn.v4_model import DeepseekV4DecoderLayer, DeepseekV4LanguageModel
from jax_dsa.nn.v4_moe import DeepseekV4MoE
from jax_dsa.nn.v4_mtp import DeepseekV4MTPLayer

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
