"""``sparse_mla``: sparse attention over MLA's shared latent rows.

Modules: :mod:`~jax_dsa.ops.sparse_mla.op` (the public op: validation, the implementation
choice, the custom VJP), :mod:`~jax_dsa.ops.sparse_mla.sharding` (its sharding contract) and one
module per implementation: :mod:`~jax_dsa.ops.sparse_mla.xla`, :mod:`~jax_dsa.ops.sparse_mla.cpu`,
:mod:`~jax_dsa.ops.sparse_mla.cuda`.
"""

from jax_dsa.ops.sparse_mla.op import (
    AVAILABLE,
    IMPLEMENTATIONS,
    LSE_NAME,
    OUT_NAME,
    REGISTRY,
    RESIDUAL_NAMES,
    sparse_mla,
)

__all__ = ["AVAILABLE", "IMPLEMENTATIONS", "LSE_NAME", "OUT_NAME", "REGISTRY", "RESIDUAL_NAMES",
           "sparse_mla"]
