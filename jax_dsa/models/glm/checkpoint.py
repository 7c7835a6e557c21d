"""Loading GLM-5 / GLM-5.2 / DeepSeek V3.2 checkpoints (transformers' ``GlmMoeDsaForCausalLM`` /
``DeepseekV32ForCausalLM`` safetensors) into :mod:`jax_dsa.models.glm`: what
:func:`jax_dsa.interop.load_hf` and :func:`jax_dsa.interop.load_hf_attention` do for these
``model_type`` values.

The model is first built abstractly (``nnx.eval_shape``: shapes, dtypes and logical axes, no
memory); each parameter is then streamed from the checkpoint, one device slice at a time, by
:func:`jax_dsa.interop.reading.fill_state`, which also dequantises block-scaled FP8 weights
(:class:`jax_dsa.interop.reading.CheckpointSource`). Keys: :mod:`jax_dsa.models.glm.hf_names`.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_dsa.interop.hf_config import config_to_hf, read_hf_config
from jax_dsa.interop.reading import CheckpointSource, fill_state
from jax_dsa.interop.safetensors_io import (
    CheckpointReader,
    CheckpointWriter,
    host_array,
    tied_lm_head,
)
from jax_dsa.models.glm.attention import DSAAttention
from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.models.glm.hf_config import config_from_hf
from jax_dsa.models.glm.hf_names import hf_key, is_ignored_key
from jax_dsa.models.glm.model import DSALanguageModel


def _check_keys(reader, consumed, missing, num_hidden_layers, tied, what):
    if missing:
        raise ValueError(
            f"{what}: the checkpoint lacks {len(missing)} tensors the model needs, e.g. "
            f"{missing[:5]}"
        )
    unexpected = [
        k for k in reader.keys()
        if k not in consumed and not is_ignored_key(k, num_hidden_layers)
        and not (tied and k == "lm_head.weight")
    ]
    if unexpected:
        raise ValueError(
            f"{what}: {len(unexpected)} checkpoint tensors belong to no supported layer, e.g. "
            f"{unexpected[:5]}"
        )


def load_glm(path: str | os.PathLike, *, dtype=jnp.bfloat16, compute_dtype=None,
             mesh: Mesh | None = None, rules=None, hf: dict | None = None,
             config: DSAConfig | None = None) -> DSALanguageModel:
    """A :class:`~jax_dsa.models.glm.model.DSALanguageModel` with a checkpoint's weights.

    Args and result: those of :func:`jax_dsa.interop.load_hf`; ``hf``: the ``config.json``
    dict and ``config`` its :class:`~jax_dsa.models.glm.config.DSAConfig`, if already read.

    Raises:
      FileNotFoundError: no ``config.json`` or no safetensors file.
      ValueError: an unsupported config (:func:`jax_dsa.models.glm.hf_config.config_from_hf`),
        a tensor of the wrong shape, tensors missing, or tensors that belong to no supported
        layer.
    """
    hf = read_hf_config(path) if hf is None else hf
    config = config_from_hf(hf) if config is None else config
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    abs_model = nnx.eval_shape(
        lambda: DSALanguageModel(
            config, rngs=nnx.Rngs(0), dtype=compute_dtype, param_dtype=dtype
        )
    )
    graphdef, abs_state = nnx.split(abs_model)
    tied = bool(config.tie_word_embeddings)

    def key_of(p):
        if tied and p == ("lm_head", "weight"):
            return "model.embed_tokens.weight", False
        return hf_key(p)

    with CheckpointReader(path) as reader:
        state, consumed, missing = fill_state(
            abs_state, CheckpointSource(reader, hf), key_of, mesh, rules
        )
        _check_keys(reader, consumed, missing, config.num_hidden_layers, tied, "load_hf")
    return nnx.merge(graphdef, state)


def load_glm_attention(path: str | os.PathLike, layer: int, *, dtype=jnp.float32,
                       mesh: Mesh | None = None, rules=None, hf: dict | None = None,
                       config: DSAConfig | None = None) -> nnx.State:
    """One layer's attention and indexer parameters: the ``nnx.State`` of a
    :class:`~jax_dsa.models.glm.attention.DSAAttention` (see
    :func:`jax_dsa.interop.load_hf_attention`); ``hf`` and ``config`` as in :func:`load_glm`.

    Raises:
      ValueError: ``layer`` out of range, or the layer's tensors missing / of the wrong shape.
    """
    hf = read_hf_config(path) if hf is None else hf
    config = config_from_hf(hf) if config is None else config
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"load_hf_attention: layer must be in [0, {config.num_hidden_layers}), got {layer}"
        )
    abs_attn = nnx.eval_shape(
        lambda: DSAAttention(config, layer, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    _, abs_state = nnx.split(abs_attn)
    prefix = f"model.layers.{layer}.self_attn."
    with CheckpointReader(path) as reader:
        state, consumed, missing = fill_state(
            abs_state, CheckpointSource(reader, hf), lambda p: hf_key(p, prefix), mesh, rules
        )
        if missing:
            raise ValueError(
                f"load_hf_attention: the checkpoint lacks layer {layer}'s tensors {missing[:5]}"
            )
        extra = [k for k in reader.keys() if k.startswith(prefix) and k not in consumed]
        if extra:
            raise ValueError(f"load_hf_attention: unknown attention tensors {extra[:5]}")
    return state


def save_glm(model: DSALanguageModel, path: str | os.PathLike, *, max_shard_size: int | str,
             dtype_name: str) -> list[str]:
    """Write ``model`` (what :func:`jax_dsa.interop.save_hf` does for it): ``config.json``
    (:func:`jax_dsa.interop.config_to_hf`, ``torch_dtype`` ``dtype_name``) and safetensors shards
    with the keys and ``[out, in]`` layouts of transformers' ``GlmMoeDsaForCausalLM`` /
    ``DeepseekV32ForCausalLM`` (stacked experts split back into ``experts.{e}.*.weight``), in
    each parameter's own dtype, so that ``from_pretrained`` rebuilds the same model. Parameters
    are fetched to the host one at a time (one expert at a time for stacked experts); only the
    shard being written is held in host memory. Returns the safetensors file names; raises as
    ``save_hf`` documents.
    """
    config = model.config
    path = os.fspath(path)
    _, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    hf = config_to_hf(config, dtype=dtype_name)
    tied = tied_lm_head(model)
    writer = CheckpointWriter(path, max_shard_size)
    try:
        for p, var in flat:
            key, stacked = hf_key(p)
            if tied and key == "lm_head.weight":
                continue
            value = var.get_value()
            if stacked:
                for e in range(value.shape[0]):
                    writer.add(key.format(expert=e), host_array(value[e]))
            else:
                writer.add(key, host_array(value))
    except BaseException:
        writer.abort()
        raise
    # config.json is committed with the weights: an interrupted save leaves the old pair whole.
    return writer.finish(config=hf)


__all__ = ["load_glm", "load_glm_attention", "save_glm"]
