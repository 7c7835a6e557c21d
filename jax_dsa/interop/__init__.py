"""Hugging Face interop: load GLM-5 / GLM-5.2 / DeepSeek V3.2 / DeepSeek V4 checkpoints, save
them back.

* :func:`load_hf` -> a :class:`jax_dsa.nn.DSALanguageModel` with the checkpoint's weights
  (streamed tensor by tensor, optionally straight onto a mesh); for ``model_type:
  "deepseek_v4"`` a :class:`jax_dsa.nn.DeepseekV4LanguageModel` (:mod:`jax_dsa.interop.v4_lm`,
  any layout :mod:`jax_dsa.interop.v4_layouts` reads).
* :func:`load_hf_attention` -> one layer's attention + indexer parameters.
* :func:`save_hf` -> a checkpoint directory transformers loads with identical logits.
* :func:`config_from_hf` / :func:`config_to_hf` / :func:`load_hf_config`: the config mapping.

The reference is transformers' ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` /
``DeepseekV4ForCausalLM`` (tests/test_interop_hf.py and tests/test_interop_v4_lm.py compare
logits with it).
"""

from jax_dsa.interop.hf_config import MODEL_TYPES, config_from_hf, config_to_hf, read_hf_config
from jax_dsa.interop.loader import load_hf, load_hf_attention, load_hf_config
from jax_dsa.interop.saver import save_hf

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
