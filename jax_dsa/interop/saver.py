"""Saving a model as a Hugging Face checkpoint directory: the dispatcher to each family's writer
(:func:`jax_dsa.models.glm.checkpoint.save_glm`,
:func:`jax_dsa.models.deepseek_v4.checkpoint.save_v4`).
"""

from __future__ import annotations

import os

import numpy as np

from jax_dsa.models.deepseek_v4.checkpoint import save_v4
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.glm.checkpoint import save_glm
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
    return save_glm(model, path, max_shard_size=max_shard_size,
                    dtype_name=_dtype_name(model.embed_tokens.weight[...].dtype))
