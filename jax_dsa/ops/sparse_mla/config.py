"""The static description of one ``sparse_mla`` call, shared by the op and its implementations."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's ``supported`` check sees of a call (after validation).

    Attributes:
      dtype: q's and kv's dtype. h: heads. d_qk: key width. d_v: value width. topk: slots K.
      deterministic: bitwise reproducible gradients were asked for.
    """

    dtype: np.dtype
    h: int
    d_qk: int
    d_v: int
    topk: int
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    """The static configuration of the custom VJP (hashable).

    Attributes:
      sm_scale: softmax scale. d_v: value width.
      implementation: the chosen :class:`jax_dsa.ops.registry.Implementation`.
      block_q: query rows per block of the ``"xla"`` implementation.
      deterministic: the backward sums in a fixed order (:mod:`jax_dsa.ops.determinism`).
    """

    sm_scale: float
    d_v: int
    implementation: object
    block_q: int
    deterministic: bool = False
