"""The lightning indexer of DeepSeek Sparse Attention: top-k selection and its KL losses.

One package per op, each with its op module, config, implementations (``xla``, ``cuda``) and
registry: :mod:`~jax_dsa.ops.indexer.topk` (``indexer_topk``),
:mod:`~jax_dsa.ops.indexer.kl_loss` (``indexer_kl_loss``, DeepSeek V3.2 / GLM-5; also the KL
losses' shared custom VJP and sharding contract), :mod:`~jax_dsa.ops.indexer.v4_kl_loss`
(DeepSeek V4's loss). The index scores they share: :mod:`~jax_dsa.ops.indexer.scores`.
"""

from jax_dsa.ops.indexer.kl_loss import REGISTRY as KL_REGISTRY
from jax_dsa.ops.indexer.kl_loss import indexer_kl_loss
from jax_dsa.ops.indexer.topk import REGISTRY as TOPK_REGISTRY
from jax_dsa.ops.indexer.topk import indexer_topk
from jax_dsa.ops.indexer.v4_kl_loss import REGISTRY as V4_KL_REGISTRY
from jax_dsa.ops.indexer.v4_kl_loss import v4_indexer_kl_loss
from jax_dsa.ops.visibility import visible_mask

__all__ = ["KL_REGISTRY", "TOPK_REGISTRY", "V4_KL_REGISTRY", "indexer_kl_loss", "indexer_topk",
           "v4_indexer_kl_loss", "visible_mask"]
