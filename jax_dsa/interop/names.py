"""The per-expert checkpoint keys of a stacked expert parameter.

jax_dsa stacks the routed experts (``mlp.experts.gate_proj [E, I, H]``); checkpoints that store
one tensor per expert name them by a key template with ``{expert}`` (e.g.
``model.layers.3.mlp.experts.{expert}.up_proj.weight``, from a family's state-path -> key map
such as :func:`jax_dsa.models.glm.hf_names.hf_key`), which
:func:`jax_dsa.interop.reading.fill_state` expands with :func:`expert_keys`.
"""

from __future__ import annotations


def expert_keys(template: str, n_experts: int) -> list[str]:
    """The per-expert keys of a stacked parameter (``template`` with ``{expert}`` = 0, 1, ...)."""
    return [template.format(expert=e) for e in range(n_experts)]
