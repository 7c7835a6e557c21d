"""``grouped_matmul``: the routed experts' grouped matrix product (``jax.lax.ragged_dot``'s
contract) with a custom VJP.

Modules: :mod:`~jax_dsa.ops.grouped_matmul.op` (the public op: validation, the implementation
choice, the custom VJP), :mod:`~jax_dsa.ops.grouped_matmul.config`, and one module per
implementation: :mod:`~jax_dsa.ops.grouped_matmul.xla`, :mod:`~jax_dsa.ops.grouped_matmul.cuda`.
"""

from jax_dsa.ops.grouped_matmul.op import REGISTRY, grouped_matmul

__all__ = ["REGISTRY", "grouped_matmul"]
