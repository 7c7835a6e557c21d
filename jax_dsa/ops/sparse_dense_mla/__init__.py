"""``sparse_dense_mla`` (DeepSeek V4's HCA and dense CSA attention): one softmax over a slot list
and every visible row of a second key set, built on ``sparse_mla`` and ``dense_mla`` (:mod:`.op`)."""

from jax_dsa.ops.sparse_dense_mla.op import sparse_dense_mla

__all__ = ["sparse_dense_mla"]
