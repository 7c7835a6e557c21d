"""``v4_indexer_kl_loss`` (DeepSeek V4): the op (:mod:`.op`), implementations ``"xla"``
(:mod:`.xla`) and ``"cuda"`` (:mod:`.cuda`); config and VJP are :mod:`jax_dsa.ops.indexer.kl_loss`'s."""

from jax_dsa.ops.indexer.v4_kl_loss.op import REGISTRY, v4_indexer_kl_loss

__all__ = ["REGISTRY", "v4_indexer_kl_loss"]
