"""GLM-5 / V3.2 parameter names: a state path of :mod:`jax_dsa.models.glm` <-> a Hugging Face
checkpoint key.

The modules keep transformers' module names, so a key is the state path joined by dots with the
``model.`` prefix of ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` (``lm_head`` has none).
The one exception is the routed experts: jax_dsa stacks them (``mlp.experts.gate_proj
[E, I, H]``), the checkpoints store one tensor per expert (``mlp.experts.{e}.gate_proj.weight``;
:func:`jax_dsa.interop.names.expert_keys` expands the ``{expert}`` template of :func:`hf_key`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def hf_key(path: Sequence, prefix: str | None = None) -> tuple[str, bool]:
    """The checkpoint key of a state path, and whether the parameter stacks experts.

    Args:
      path: an NNX state path, e.g. ``("layers", 0, "self_attn", "q_a_proj", "weight")``.
      prefix: key prefix; ``None`` picks ``"model."`` (``""`` for ``lm_head``).

    Returns:
      ``(key, stacked)``. For a stacked expert parameter the key contains ``{expert}`` to be
      formatted with the expert index, e.g. ``model.layers.3.mlp.experts.{expert}.up_proj.weight``.
    """
    parts = [str(p) for p in path]
    if prefix is None:
        prefix = "" if parts[0] == "lm_head" else "model."
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_PROJS:
        return prefix + ".".join(parts[:-1]) + ".{expert}." + parts[-1] + ".weight", True
    return prefix + ".".join(parts), False


def layer_of(key: str) -> int | None:
    """The decoder layer index in ``model.layers.N....``, else ``None``."""
    m = _LAYER_KEY.match(key)
    return int(m.group(1)) if m else None


def is_ignored_key(key: str, num_hidden_layers: int) -> bool:
    """Checkpoint entries that jax_dsa does not build: MTP / next-token-prediction layers
    (``model.layers.N`` with ``N >= num_hidden_layers``, e.g. GLM-5's layer 78) and RoPE caches."""
    layer = layer_of(key)
    if layer is not None and layer >= num_hidden_layers:
        return True
    return key.endswith("rotary_emb.inv_freq")
