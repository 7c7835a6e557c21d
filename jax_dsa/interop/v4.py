"""DeepSeek V4 attention weights from a checkpoint in any layout (see
:mod:`jax_dsa.interop.v4_layouts`).


:class:`jax_dsa.nn.v4_attention.DeepseekV4Attention` keeps transformers' module names, so a
parameter's ``state_dict`` name is its state path joined by dots after
``model.layers.{i}.self_attn.``. :func:`load_v4_attention` reads those names through
:func:`jax_dsa.interop.v4_layouts.open_v4_checkpoint`, which presents transformers'
``save_pretrained`` output (``model.layers.{i}.attn.*``), DeepSeek's released naming
(``layers.{i}.attn.*``) and the in-memory names alike, and dequantises block-scaled FP8 (``.scale``
or ``weight_scale_inv``) on the fly. :data:`ORIGINAL_NAMES` maps the attention parameters to
DeepSeek's names exactly as transformers' ``deepseek_v4`` checkpoint conversion does
(``conversion_mapping.py``, transformers 5.24; checked against it by tests/test_nn_v4_attention.py).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_dsa.configs.v4 import DeepseekV4Config
from jax_dsa.interop.hf_config import read_hf_config
from jax_dsa.interop.reading import fill_state
from jax_dsa.interop.v4_layouts import LAYER_NAMES, open_v4_checkpoint
from jax_dsa.nn.v4_attention import DeepseekV4Attention

MODEL_TYPE = "deepseek_v4"

# transformers' parameter name (relative to self_attn) -> DeepSeek's (relative to attn).
ORIGINAL_NAMES: dict[str, str] = {
    name.removeprefix("self_attn."): disk[1].removeprefix("attn.")
    for name, disk in LAYER_NAMES.items() if name.startswith("self_attn.")
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
    rngs=nnx.Rngs(0)); nnx.update(attn, state)``. The layout (transformers' ``save_pretrained``,
    DeepSeek's release, or ``state_dict`` names) and the quantisation are detected from the
    checkpoint (:func:`jax_dsa.interop.v4_layouts.open_v4_checkpoint`).

    Args:
      path: checkpoint directory (``config.json`` with ``model_type: "deepseek_v4"`` and
        safetensors files).
      layer: decoder layer index.
      dtype: storage dtype (sinks, position biases and norms stay float32).
      mesh, rules: as in :func:`jax_dsa.interop.load_hf`.

    Raises:
      ValueError: not a DeepSeek V4 config, ``layer`` out of range, the layer's tensors missing
        or of the wrong shape, unknown tensors under the layer's attention prefix, or a
        checkpoint :func:`~jax_dsa.interop.v4_layouts.open_v4_checkpoint` refuses (unsupported
        quantisation, named).
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
    prefix = attention_prefix(layer)
    with open_v4_checkpoint(path, hf) as ckpt:
        state, consumed, missing = fill_state(
            abs_state, ckpt, lambda p: (attention_key(p, layer), False), mesh, rules
        )
        if missing:
            raise ValueError(
                f"load_v4_attention: the checkpoint ({ckpt.layout} layout) lacks layer {layer}'s "
                f"tensors {missing[:5]}"
            )
        extra = [k for k in ckpt.keys() if k.startswith(prefix) and k not in consumed]
        layer_keys = (f"layers.{layer}.attn.", f"model.layers.{layer}.attn.", prefix)
        extra += [k for k in ckpt.unknown if k.startswith(layer_keys)]
        if extra:
            raise ValueError(f"load_v4_attention: unknown attention tensors {extra[:5]}")
    return state


__all__ = ["ORIGINAL_NAMES", "attention_key", "attention_prefix", "load_v4_attention"]
