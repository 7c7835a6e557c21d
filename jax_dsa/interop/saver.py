"""Saving a :class:`jax_dsa.nn.DSALanguageModel` as a Hugging Face checkpoint directory
(a :class:`jax_dsa.nn.DeepseekV4LanguageModel` goes to
:func:`jax_dsa.models.deepseek_v4.checkpoint.save_v4`).

Writes ``config.json`` (:func:`jax_dsa.interop.config_to_hf`) and safetensors shards with the
keys and ``[out, in]`` layouts of transformers' ``GlmMoeDsaForCausalLM`` /
``DeepseekV32ForCausalLM`` (stacked experts split back into ``experts.{e}.*.weight``), in each
parameter's own dtype, so that ``from_pretrained`` rebuilds the same model. Parameters are
fetched to the host one at a time (one expert at a time for stacked experts); only the shard
being written is held in host memory.
"""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from jax_dsa.interop.hf_config import config_to_hf
from jax_dsa.interop.safetensors_io import CheckpointWriter, host_array
from jax_dsa.models.deepseek_v4.checkpoint import save_v4
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.glm.hf_names import hf_key
from jax_dsa.models.glm.model import DSALanguageModel

_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def _dtype_name(dt) -> str:
    dt = np.dtype(dt)
    return _DTYPE_NAMES.get(dt, dt.name)  # ml_dtypes' bfloat16 is named "bfloat16"


def save_hf(model: DSALanguageModel | DeepseekV4LanguageModel, path: str | os.PathLike, *,
            max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``model`` as a checkpoint that transformers loads with identical logits.

    Args:
      model: a :class:`jax_dsa.nn.DSALanguageModel` (e.g. from :func:`jax_dsa.interop.load_hf`)
        whose config has ``model_type`` ``"glm_moe_dsa"`` or ``"deepseek_v32"``, or a
        :class:`jax_dsa.models.deepseek_v4.model.DeepseekV4LanguageModel` (written in transformers'
        ``save_pretrained`` layout for ``DeepseekV4ForCausalLM``, its MTP depths, if any, under
        DeepSeek's release keys ``mtp.{k}.*``, which transformers skips and ``load_hf`` reads:
        :func:`jax_dsa.models.deepseek_v4.checkpoint.save_v4`).
      path: output directory (created; an earlier checkpoint there is replaced atomically: a
        save interrupted at any moment, even by SIGKILL, leaves the old checkpoint or the new
        one, whole, for :func:`jax_dsa.interop.load_hf`; ``docs/failure_behaviour.md``).
      max_shard_size: bytes per safetensors shard (int or ``"5GB"``-style string); more than one
        shard adds ``model.safetensors.index.json``.

    Returns:
      The safetensors file names written.

    Raises:
      TypeError: ``model`` is neither a ``DSALanguageModel`` nor a ``DeepseekV4LanguageModel``.
      ValueError: a config transformers cannot represent (:func:`jax_dsa.interop.config_to_hf`),
        ``tie_word_embeddings`` with an ``lm_head`` that differs from the embedding, or
        parameters not addressable from this process.
    """
    if isinstance(model, DeepseekV4LanguageModel):
        return save_v4(model, path, max_shard_size=max_shard_size,
                       dtype_name=_dtype_name(model.embed_tokens.weight[...].dtype))
    if not isinstance(model, DSALanguageModel):
        raise TypeError(
            "save_hf: model must be a DSALanguageModel or DeepseekV4LanguageModel, got "
            f"{type(model).__name__}")
    config = model.config
    path = os.fspath(path)
    _, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    embed_dtype = model.embed_tokens.weight[...].dtype
    hf = config_to_hf(config, dtype=_dtype_name(embed_dtype))
    tied = bool(config.tie_word_embeddings)
    if tied and not np.array_equal(host_array(model.lm_head.weight[...]),
                                   host_array(model.embed_tokens.weight[...])):
        raise ValueError(
            "save_hf: tie_word_embeddings is set but lm_head differs from embed_tokens "
            "(transformers would tie them); set tie_word_embeddings=False in the config"
        )
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
