"""DeepSeek V4 attention weights from a checkpoint: transformers' names or DeepSeek's own.

:class:`jax_dsa.nn.v4_attention.DeepseekV4Attention` keeps transformers' module names, so a
parameter's key in a transformers (``save_pretrained``) checkpoint is its state path joined by
dots after ``model.layers.{i}.self_attn.``. DeepSeek's released checkpoints (deepseek-ai
DeepSeek-V4-Flash / -Pro) use ``layers.{i}.attn.`` and the reference implementation's names;
:data:`ORIGINAL_NAMES` maps between the two exactly as transformers' ``deepseek_v4`` checkpoint
conversion does (``conversion_mapping.py``, transformers 5.24; checked against it by
tests/test_nn_v4_attention.py).

Weights stored as block-scaled FP8 with ``weight_scale_inv`` (transformers' FP8 format) are
dequantised by the shared reader (:mod:`jax_dsa.interop.reading`). DeepSeek's own FP8 layout
(``.scale`` tensors in UE8M0) is not read here: convert such checkpoints with transformers first.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_dsa.configs.v4 import DeepseekV4Config
from jax_dsa.interop.hf_config import read_hf_config
from jax_dsa.interop.reading import CheckpointSource, fill_state
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.nn.v4_attention import DeepseekV4Attention

MODEL_TYPE = "deepseek_v4"

# transformers' parameter name (relative to self_attn) -> DeepSeek's (relative to attn).
ORIGINAL_NAMES: dict[str, str] = {
    "q_a_proj.weight": "wq_a.weight",
    "q_a_norm.weight": "q_norm.weight",
    "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight",
    "kv_norm.weight": "kv_norm.weight",
    "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight",
    "sinks": "attn_sink",
    "compressor.kv_proj.weight": "compressor.wkv.weight",
    "compressor.gate_proj.weight": "compressor.wgate.weight",
    "compressor.position_bias": "compressor.ape",
    "compressor.kv_norm.weight": "compressor.norm.weight",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}


def attention_prefix(layer: int, original: bool = False) -> str:
    """``model.layers.{layer}.self_attn.`` (transformers) or ``layers.{layer}.attn.`` (DeepSeek)."""
    return f"layers.{layer}.attn." if original else f"model.layers.{layer}.self_attn."


def attention_key(path, layer: int, original: bool = False) -> str:
    """The checkpoint key of a :class:`DeepseekV4Attention` state path (e.g.
    ``("compressor", "indexer", "q_b_proj", "weight")``) in either naming.

    Raises:
      KeyError: a path that is not a V4 attention parameter (DeepSeek naming only).
    """
    name = ".".join(str(p) for p in path)
    if original:
        name = ORIGINAL_NAMES[name]
    return attention_prefix(layer, original) + name


def load_v4_attention(
    path: str | os.PathLike, layer: int, *, dtype=jnp.float32, mesh: Mesh | None = None,
    rules=None,
) -> nnx.State:
    """One DeepSeek V4 layer's attention parameters (with its compressor and indexer).

    The result is the ``nnx.State`` of a :class:`jax_dsa.nn.v4_attention.DeepseekV4Attention`:
    ``attn = DeepseekV4Attention(DeepseekV4Config.from_hf_dict(read_hf_config(path)), layer,
    rngs=nnx.Rngs(0)); nnx.update(attn, state)``. The naming (transformers' or DeepSeek's) is
    detected from the checkpoint's keys.

    Args:
      path: checkpoint directory (``config.json`` with ``model_type: "deepseek_v4"`` and
        safetensors files).
      layer: decoder layer index.
      dtype: storage dtype (sinks, position biases and norms stay float32).
      mesh, rules: as in :func:`jax_dsa.interop.load_hf`.

    Raises:
      ValueError: not a DeepSeek V4 config, ``layer`` out of range, the layer's tensors missing
        or of the wrong shape, or unknown tensors under the layer's attention prefix.
    """
    hf = read_hf_config(path)
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"load_v4_attention: model_type must be {MODEL_TYPE!r}, got {hf.get('model_type')!r}"
        )
    config = DeepseekV4Config.from_hf_dict(hf)
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"load_v4_attention: layer must be in [0, {config.num_hidden_layers}), got {layer}"
        )
    abs_attn = nnx.eval_shape(
        lambda: DeepseekV4Attention(config, layer, rngs=nnx.Rngs(0), dtype=dtype,
                                    param_dtype=dtype)
    )
    _, abs_state = nnx.split(abs_attn)
    with CheckpointReader(path) as reader:
        original = attention_key(("q_a_proj", "weight"), layer, True) in reader
        prefix = attention_prefix(layer, original)
        state, consumed, missing = fill_state(
            abs_state, CheckpointSource(reader, hf),
            lambda p: (attention_key(p, layer, original), False), mesh, rules,
        )
        if missing:
            raise ValueError(
                f"load_v4_attention: the checkpoint lacks layer {layer}'s tensors {missing[:5]}"
            )
        extra = [k for k in reader.keys() if k.startswith(prefix) and k not in consumed]
        if extra:
            raise ValueError(f"load_v4_attention: unknown attention tensors {extra[:5]}")
    return state


__all__ = ["ORIGINAL_NAMES", "attention_key", "attention_prefix", "load_v4_attention"]
