"""Hugging Face interop: load GLM-5 / GLM-5.2 / DeepSeek V3.2 / DeepSeek V4 checkpoints, save
them back.

* :func:`load_hf` -> a :class:`jax_dsa.nn.DSALanguageModel` with the checkpoint's weights
  (streamed tensor by tensor, optionally straight onto a mesh); for ``model_type:
  "deepseek_v4"`` a :class:`jax_dsa.nn.DeepseekV4LanguageModel`
  (:mod:`jax_dsa.models.deepseek_v4.checkpoint`, any layout
  :mod:`jax_dsa.models.deepseek_v4.checkpoint_layouts` reads).
* :func:`load_hf_attention` -> one layer's attention + indexer parameters.
* :func:`save_hf` -> a checkpoint directory transformers loads with identical logits.
* :func:`config_from_hf` / :func:`config_to_hf` / :func:`load_hf_config`: the config mapping.

The reference is transformers' ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` /
``DeepseekV4ForCausalLM`` (tests/test_interop_hf.py and
tests/test_models_deepseek_v4_checkpoint.py compare logits with it).

This package holds what every family uses (:mod:`~jax_dsa.interop.safetensors_io`,
:mod:`~jax_dsa.interop.reading`, :mod:`~jax_dsa.models.glm.hf_names`) and the dispatchers above the
families (:mod:`~jax_dsa.interop.hf_config`, :mod:`~jax_dsa.interop.loader`,
:mod:`~jax_dsa.interop.saver`); each family's checkpoint names and loaders are in its package
(:mod:`jax_dsa.models.glm`, :mod:`jax_dsa.models.deepseek_v4`). The names below load on first
use: the families import the shared modules, so importing the dispatchers up front would make
each wait for the other.
"""

import importlib

# name -> the module that defines it
_MODULES = {
    "MODEL_TYPES": "jax_dsa.interop.hf_config",
    "config_from_hf": "jax_dsa.interop.hf_config",
    "config_to_hf": "jax_dsa.interop.hf_config",
    "read_hf_config": "jax_dsa.interop.hf_config",
    "load_hf": "jax_dsa.interop.loader",
    "load_hf_attention": "jax_dsa.interop.loader",
    "load_hf_config": "jax_dsa.interop.loader",
    "save_hf": "jax_dsa.interop.saver",
}

__all__ = [
    "MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "load_hf",
    "load_hf_attention",
    "load_hf_config",
    "read_hf_config",
    "save_hf",
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
