"""Model configurations and presets of every family, and :func:`get_config` over all of them.

* :class:`DSAConfig` (GLM-5 / GLM-5.2 / DeepSeek V3.2: MLA plus the lightning indexer) and its
  presets: :mod:`jax_dsa.models.glm.config`.
* :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config` (DeepSeek V4: sliding window, CSA
  and HCA layers) and its presets: :mod:`jax_dsa.models.deepseek_v4.config`.
* :class:`RopeParameters`, which both families use: :mod:`jax_dsa.nn.rope_parameters`.

The names exported here are those of the GLM family (:data:`PRESETS`, :data:`PRESET_NAMES`,
:func:`indexer_schedule`, and the field vocabularies ``INDEXER_TYPES``, ``MLP_LAYER_TYPES``),
the RoPE ones (``ROPE_TYPES`` too), and :func:`get_config`, which also knows the V4 presets.
"""

from __future__ import annotations

from typing import Any

from jax_dsa.models.deepseek_v4 import config as _v4
from jax_dsa.models.glm.config import (
    INDEXER_TYPES,  # noqa: F401
    MLP_LAYER_TYPES,  # noqa: F401
    PRESET_NAMES,
    PRESETS,
    DSAConfig,
    get_glm_config,
    indexer_schedule,
)
from jax_dsa.nn.rope_parameters import ROPE_TYPES, RopeParameters, yarn_get_mscale  # noqa: F401


def get_config(name: str, **overrides: Any) -> DSAConfig | _v4.DeepseekV4Config:
    """The preset ``name`` (one of :data:`PRESET_NAMES`), with optional field overrides.

    DeepSeek V4 names (``jax_dsa.models.deepseek_v4.config.PRESET_NAMES``) give a
    :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config` instead
    (:func:`jax_dsa.models.deepseek_v4.config.get_v4_config`).

    Raises:
      KeyError: an unknown preset name (the message lists the known ones).
    """
    if name in PRESETS:
        return get_glm_config(name, **overrides)
    if name in _v4.PRESETS:
        return _v4.get_v4_config(name, **overrides)
    known = PRESET_NAMES + _v4.PRESET_NAMES
    raise KeyError(f"get_config: unknown preset {name!r}; known: {known}")


__all__ = [
    "DSAConfig",
    "RopeParameters",
    "PRESETS",
    "PRESET_NAMES",
    "get_config",
    "indexer_schedule",
    "yarn_get_mscale",
]
