"""``indexer_topk``: the lightning indexer's scores and exact top-k (:mod:`.op`), its static
config (:mod:`.config`), implementations ``"xla"`` (:mod:`.xla`) and ``"cuda"`` (:mod:`.cuda`)."""

from jax_dsa.ops.indexer.topk.op import REGISTRY, indexer_topk

__all__ = ["REGISTRY", "indexer_topk"]
