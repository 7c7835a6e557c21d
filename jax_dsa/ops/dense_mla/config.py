"""The static description of one ``dense_mla`` call, shared by the op and its implementations."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's ``supported`` check sees of a call (after validation).

    Attributes:
      dtype: q's and kv's dtype. h: heads. d_qk: key width. d_v: value width.
      s_q, s_kv: query and key rows per batch element. segmented: segment ids were given.
      deterministic: bitwise reproducible gradients were asked for.
    """

    dtype: np.dtype
    h: int
    d_qk: int
    d_v: int
    s_q: int
    s_kv: int
    segmented: bool
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    """The static configuration of the custom VJP (hashable).

    Attributes:
      sm_scale: softmax scale. d_v: value width.
      implementation: the chosen :class:`jax_dsa.ops.registry.Implementation`, whose
        ``forward`` runs the forward pass.
      backward_implementation: the one whose ``backward`` runs the backward pass: the chosen one,
        or ``"xla"``'s when the chosen one has none.
      block_q: query rows per block of the ``"xla"`` implementation (its forward and backward).
      deterministic: the backward sums in a fixed order (:mod:`jax_dsa.ops.determinism`).
    """

    sm_scale: float
    d_v: int
    implementation: object
    backward_implementation: object
    block_q: int
    deterministic: bool = False
