"""Model configurations and presets, by family, and :func:`get_config` over all of them.

* :mod:`jax_dsa.configs.glm`: :class:`DSAConfig` for GLM-5 / GLM-5.2 / DeepSeek V3.2 (MLA plus
  the lightning indexer) and their tiny versions.
* :mod:`jax_dsa.configs.v4`: :class:`~jax_dsa.configs.v4.DeepseekV4Config` for DeepSeek V4
  (sliding window, CSA and HCA layers) and its tiny version.
* :mod:`jax_dsa.configs.rope`: :class:`RopeParameters`, which both families use.

The families import only :mod:`jax_dsa.configs.rope`; this package imports both. The names
exported here are those of the GLM family (:data:`PRESETS`, :data:`PRESET_NAMES`), plus
:func:`get_config`, which also knows the V4 presets.
"""

from __future__ import annotations

from typing import Any

from jax_dsa.configs import v4
from jax_dsa.configs.glm import (  # the *_TYPES: module attributes of the old single module
    INDEXER_TYPES,  # noqa: F401
    MLP_LAYER_TYPES,  # noqa: F401
    PRESET_NAMES,
    PRESETS,
    DSAConfig,
    get_glm_config,
    indexer_schedule,
)
from jax_dsa.configs.rope import ROPE_TYPES, RopeParameters, yarn_get_mscale  # noqa: F401


def get_config(name: str, **overrides: Any) -> DSAConfig | v4.DeepseekV4Config:
    """The preset ``name`` (one of :data:`PRESET_NAMES`), with optional field overrides.

    DeepSeek V4 names (``jax_dsa.configs.v4.PRESET_NAMES``) give a
    :class:`~jax_dsa.configs.v4.DeepseekV4Config` instead
    (:func:`jax_dsa.configs.v4.get_v4_config`).

    Raises:
      KeyError: an unknown preset name (the message lists the known ones).
    """
    if name in PRESETS:
        return get_glm_config(name, **overrides)
    if name in v4.PRESETS:
        return v4.get_v4_config(name, **overrides)
    known = PRESET_NAMES + v4.PRESET_NAMES
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
