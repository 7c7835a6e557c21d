"""The static description of one ``grouped_matmul`` call, shared by the op and its
implementations."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's ``supported`` check sees of a call (after validation).

    Attributes:
      dtype: ``lhs``'s and ``rhs``'s dtype. m: rows. k: contracting width. n: output width.
      groups: G, the number of groups (experts). out_dtype: the result's dtype.
    """

    dtype: np.dtype
    m: int
    k: int
    n: int
    groups: int
    out_dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class Config:
    """The static configuration of the custom VJP (hashable).

    Attributes:
      implementation: the chosen :class:`jax_dsa.ops.registry.Implementation`.
      out_dtype: the result's dtype.
      transpose_rhs: ``rhs`` is ``[G, N, K]``.
    """

    implementation: object
    out_dtype: np.dtype
    transpose_rhs: bool = False
