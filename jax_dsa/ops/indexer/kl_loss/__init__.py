"""``indexer_kl_loss`` (DeepSeek V3.2 / GLM-5): the op (:mod:`.op`), its static config
(:mod:`.config`), the custom VJP and sharding contract that the V4 loss shares (:mod:`.vjp`), the
shared checks and block math (:mod:`.common`), implementations ``"xla"`` (:mod:`.xla`) and
``"cuda"`` (:mod:`.cuda`)."""

from jax_dsa.ops.indexer.kl_loss.op import REGISTRY, indexer_kl_loss

__all__ = ["REGISTRY", "indexer_kl_loss"]
