"""jax_dsa: DeepSeek Sparse Attention (DSA) for JAX training."""

from jax_dsa.ops.dense_mla import dense_mla
from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk, v4_indexer_kl_loss, visible_mask
from jax_dsa.ops.sparse_dense_mla import sparse_dense_mla
from jax_dsa.ops.sparse_mla import sparse_mla

__all__ = ["sparse_mla", "dense_mla", "sparse_dense_mla", "indexer_topk", "indexer_kl_loss",
           "v4_indexer_kl_loss", "visible_mask"]
__version__ = "0.1.0"

_SUBPACKAGES = ("configs", "interop", "models", "nn", "ops", "sharding")


def __getattr__(name):
    # `jax_dsa.nn`, `jax_dsa.configs`, ... on first use: `import jax_dsa` loads only the ops.
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
