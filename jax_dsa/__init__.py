"""jax_dsa: DeepSeek Sparse Attention (DSA) for JAX training."""

from jax_dsa.ops.sparse_mla import sparse_mla

__all__ = ["sparse_mla"]
__version__ = "0.1.0"
