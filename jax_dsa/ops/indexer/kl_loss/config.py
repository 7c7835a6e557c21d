"""The static descriptions of indexer KL-loss (``indexer_kl_loss``, ``v4_indexer_kl_loss``) calls, shared by the op and its implementations."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class KLCall:
    """What a KL-loss implementation's ``supported`` check sees of a call (after validation).

    Attributes:
      dtype: the promoted dtype of every float input. index_n_heads, index_head_dim: the
      indexer's heads and width. h, d_qk: the main attention's heads and width. s_q, s_kv: query
      and key counts. topk: slots per query, ``None`` for the dense form. segments: whether
      segment ids were given. given_lse: whether the target's denominators were given
      (``attention_lse``). deterministic: bitwise reproducible gradients were asked for.
    """

    dtype: np.dtype
    index_n_heads: int
    index_head_dim: int
    h: int
    d_qk: int
    s_q: int
    s_kv: int
    topk: int | None
    segments: bool
    given_lse: bool = False
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class KLConfig:
    """Static configuration of one KL-loss call (hashable).

    Attributes:
      sm_scale: the main attention's softmax scale.
      h: the main attention's total head count (the target's head mean spans every head shard).
      block_q: query rows per block of the ``"xla"`` implementation.
      implementation: the chosen :class:`jax_dsa.ops.registry.Implementation`.
      given_lse: ``indexer_kl_loss`` only: the operands hold ``attention_lse`` before the slots
        (the target's per-head denominators are given, not recomputed).
      given_scores: ``indexer_kl_loss`` only: the operands hold ``index_scores`` just before the
        slots (the index scores of the slots, from the top-k).
      deterministic: ``d index_k`` summed as 64-bit fixed point, whose integer sum does not
        depend on the order (bitwise reproducible gradients; :mod:`jax_dsa.ops.determinism`).
    """

    sm_scale: float
    h: int
    block_q: int
    implementation: object
    given_lse: bool = False
    given_scores: bool = False
    deterministic: bool = False

    def unpack(self, rest):
        """``(attention_lse, index_scores, slots)`` from the operands after ``kv`` (``None``
        for an absent one)."""
        *given, idx = rest
        lse = given.pop(0) if self.given_lse else None
        scores = given.pop(0) if self.given_scores else None
        return lse, scores, idx
