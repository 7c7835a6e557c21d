"""Hugging Face ``config.json`` <-> a family's config, by ``model_type``, as transformers reads it.

* ``"glm_moe_dsa"``, ``"deepseek_v32"`` (:data:`MODEL_TYPES`):
  :class:`~jax_dsa.models.glm.config.DSAConfig` (GLM-5 / GLM-5.2 / DeepSeek V3.2), through
  :mod:`jax_dsa.models.glm.hf_config`, which also says which keys transformers ignores.
* ``"deepseek_v4"`` (:data:`V4_MODEL_TYPE`):
  :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`, transformers'
  ``DeepseekV4Config``
  (:meth:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config.from_hf_dict` /
  :meth:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config.to_hf_dict`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jax_dsa.models.deepseek_v4.config import MODEL_TYPE as V4_MODEL_TYPE
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.glm import hf_config as glm_hf_config
from jax_dsa.models.glm.config import DSAConfig

MODEL_TYPES = glm_hf_config.MODEL_TYPES
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory as a dict.

    Reads the ``config.json`` of the checkpoint committed last, also while a save (or a killed
    one) has not yet moved its files into place (:mod:`jax_dsa.interop.safetensors_io`).

    Raises:
      FileNotFoundError: ``path`` has no ``config.json``.
      ValueError: a ``config.json`` that is not JSON or not a JSON object (the file named).
    """
    from jax_dsa.interop import safetensors_io

    safetensors_io.prepare_read(path)
    file = safetensors_io.committed_file(path, "config.json") if os.path.isdir(path) else None
    if file is None:
        raise FileNotFoundError(f"read_hf_config: no config.json in {os.fspath(path)!r}")
    config = safetensors_io.read_json(file, "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"damaged config.json {file}: a JSON {type(config).__name__}, not an "
                         "object of config keys")
    return config


def config_from_hf(d: Mapping[str, Any]) -> DSAConfig | DeepseekV4Config:
    """The config that means what transformers' model of ``d`` computes.

    Args:
      d: a ``config.json`` dict with ``model_type`` in :data:`MODEL_TYPES` or
        ``"deepseek_v4"``.

    Returns:
      A :class:`~jax_dsa.models.glm.config.DSAConfig` with every DSA, RoPE (YaRN and its
      mscale), MoE and IndexShare field (:func:`jax_dsa.models.glm.hf_config.config_from_hf`);
      for ``"deepseek_v4"`` a :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`.

    Raises:
      ValueError: another ``model_type``, a RoPE type other than ``default`` / ``yarn``, a
        ``partial_rotary_factor`` other than 1, an unsupported quantisation method, or any of
        the config class's own checks.
    """
    d = dict(d)
    model_type = d.get("model_type")
    if model_type == V4_MODEL_TYPE:
        return DeepseekV4Config.from_hf_dict(d)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config_from_hf: model_type must be one of {MODEL_TYPES + (V4_MODEL_TYPE,)}, got "
            f"{model_type!r}"
        )
    return glm_hf_config.config_from_hf(d)


def config_to_hf(config: DSAConfig | DeepseekV4Config, *, dtype: str | None = None
                 ) -> dict[str, Any]:
    """A ``config.json`` dict that transformers reads back as the same model.

    ``num_nextn_predict_layers`` is written as 0 (``save_hf`` sets it for a DeepSeek V4 model
    that has MTP layers, which it saves). A :class:`~jax_dsa.models.glm.config.DSAConfig` goes
    to :func:`jax_dsa.models.glm.hf_config.config_to_hf`; a
    :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config` gives its
    :meth:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config.to_hf_dict` with
    ``architectures`` and ``model_type``.

    Args:
      config: the model's config.
      dtype: optional ``"float32"`` / ``"bfloat16"`` ... for the ``dtype`` key.

    Raises:
      ValueError: what transformers cannot represent (see
        :func:`jax_dsa.models.glm.hf_config.config_to_hf`).
    """
    if isinstance(config, DeepseekV4Config):
        out = {"architectures": [V4_ARCHITECTURE], "model_type": V4_MODEL_TYPE}
        out.update(config.to_hf_dict())
        out["num_nextn_predict_layers"] = 0
        if dtype is not None:
            out["dtype"] = dtype
        return out
    return glm_hf_config.config_to_hf(config, dtype=dtype)


__all__ = [
    "MODEL_TYPES",
    "V4_MODEL_TYPE",
    "config_from_hf",
    "config_to_hf",
    "read_hf_config",
]
