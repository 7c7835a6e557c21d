"""Sharding of the DSA ops and layers: data (dp), expert (ep), tensor (tp) and context (cp)
parallelism.

* :mod:`~jax_dsa.sharding.partition`: the engine the ops split themselves with under
  ``jax.jit`` (custom_partitioning with a Shardy rule for ``Auto`` mesh axes, ``shard_map`` for
  ``Explicit`` ones); each op's role tables live in its own package (``jax_dsa.ops``).
* :mod:`~jax_dsa.sharding.rules`: logical axis names -> mesh axes (:data:`DEFAULT_RULES`).
* :mod:`~jax_dsa.sharding.constraints`: :func:`constrain`, the layers' activation constraints.
* :mod:`~jax_dsa.sharding.expert_dispatch`: expert parallelism's all-to-all token exchange.
* :mod:`~jax_dsa.sharding.zigzag`: causal load balance of context parallelism.
"""

from jax_dsa.sharding.constraints import constrain
from jax_dsa.sharding.partition import (
    Layout,
    Result,
    derive_layout,
    head_logsumexp,
    partitioned_call,
    typed_like,
)
from jax_dsa.sharding.rules import (
    CONTEXT,
    DATA,
    DEFAULT_RULES,
    EXPERT,
    MESH_AXES,
    TENSOR,
    axis_rules,
    current_rules,
    logical_to_spec,
)
from jax_dsa.sharding.zigzag import (
    causal_work,
    from_zigzag,
    imbalance,
    to_zigzag,
    work_per_shard,
    zigzag_permutation,
)

__all__ = [
    "CONTEXT",
    "DATA",
    "DEFAULT_RULES",
    "EXPERT",
    "Layout",
    "MESH_AXES",
    "Result",
    "TENSOR",
    "axis_rules",
    "causal_work",
    "constrain",
    "current_rules",
    "derive_layout",
    "from_zigzag",
    "head_logsumexp",
    "imbalance",
    "logical_to_spec",
    "partitioned_call",
    "to_zigzag",
    "typed_like",
    "work_per_shard",
    "zigzag_permutation",
]
