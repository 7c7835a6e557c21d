"""``dense_mla``: dense causal attention over MLA's shared latent rows, from positions and segment
ids (the dense warm-up stage), with :func:`jax_dsa.sparse_mla`'s conventions.

Modules: :mod:`~jax_dsa.ops.dense_mla.op` (the public op: validation, the implementation choice,
the custom VJP; its docstring says how an implementation plugs in),
:mod:`~jax_dsa.ops.dense_mla.sharding` (its sharding contract) and one module per implementation:
:mod:`~jax_dsa.ops.dense_mla.xla`.
"""

from jax_dsa.ops.dense_mla.op import (
    IMPLEMENTATIONS,
    LSE_NAME,
    OUT_NAME,
    REGISTRY,
    RESIDUAL_NAMES,
    dense_mla,
)

__all__ = ["IMPLEMENTATIONS", "LSE_NAME", "OUT_NAME", "REGISTRY", "RESIDUAL_NAMES", "dense_mla"]
