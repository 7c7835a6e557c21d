"""Sharding of the DSA ops and layers: data (dp), tensor (tp) and context (cp) parallelism.

* :mod:`~jax_dsa.sharding.partition`: how ``sparse_mla``, ``indexer_topk`` and
  ``indexer_kl_loss`` split themselves under ``jax.jit`` (custom_partitioning with a Shardy
  rule for ``Auto`` mesh axes, ``shard_map`` for ``Explicit`` ones).
* :mod:`~jax_dsa.sharding.rules`: logical axis names -> mesh axes (:data:`DEFAULT_RULES`).
* :mod:`~jax_dsa.sharding.constraints`: :func:`constrain`, the layers' activation constraints.
* :mod:`~jax_dsa.sharding.zigzag`: causal load balance of context parallelism.
"""

from jax_dsa.sharding.constraints import constrain
from jax_dsa.sharding.partition import Layout, derive_layout, head_logsumexp, partitioned_call
from jax_dsa.sharding.rules import (
    CONTEXT,
    DATA,
    DEFAULT_RULES,
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
    "Layout",
    "MESH_AXES",
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
    "work_per_shard",
    "zigzag_permutation",
]
