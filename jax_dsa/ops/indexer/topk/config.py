"""The static descriptions of ``indexer_topk`` calls, shared by the op and its implementations."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TopkCall:
    """What a top-k implementation's ``supported`` check sees of a call (after validation).

    Attributes:
      dtype: the promoted dtype of ``q``, ``k``, ``weights``. index_n_heads, index_head_dim: the
      indexer's heads and width. s_q, s_kv: query and key counts. topk: keys selected per query (``min(topk, S_kv)``).
      segments: whether segment ids were given. fp8: ``qk_dtype`` is float8_e4m3fn (the
      implementation gets fp8 ``q`` and ``k`` and the keys' scales).
    """

    dtype: np.dtype
    index_n_heads: int
    index_head_dim: int
    s_q: int
    s_kv: int
    topk: int
    segments: bool
    fp8: bool = False


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """Static configuration of one top-k call (hashable).

    Attributes:
      topk: keys per query actually selected (``min(topk, S_kv)``; the op pads the rest).
      block_q: query rows per block of the ``"xla"`` implementation.
      implementation: the chosen :class:`jax_dsa.ops.registry.Implementation`.
      scores: also return the selected keys' scores (``indexer_topk(return_scores=True)``).
    """

    topk: int
    block_q: int
    implementation: object
    scores: bool = False
