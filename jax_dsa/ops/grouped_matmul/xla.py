"""The ``"xla"`` implementation of ``grouped_matmul``: ``jax.lax.ragged_dot`` and its transpose
rules, the portable reference.

XLA's GPU compiler expands a ragged dot into dense products over every group (work and memory
grow with ``G * M``), so this implementation is for the host, tests and small group counts; the
``"cuda"`` one is for real expert counts on SM90 GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.blocks import acc_dtype
from jax_dsa.ops.grouped_matmul.config import Config
from jax_dsa.ops.registry import Implementation, always

_HIGHEST = jax.lax.Precision.HIGHEST


def _ragged_dot(lhs, rhs, group_sizes, transpose_rhs):
    # HIGHEST: float32 inputs are not rounded to TF32 on GPUs; 16-bit products are exact.
    rhs_contract = 2 if transpose_rhs else 1
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [rhs_contract]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, precision=_HIGHEST,
                                      preferred_element_type=acc_dtype(lhs, rhs))


def forward(lhs, rhs, group_sizes, config: Config):
    """``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` transposed), clamped ``group_sizes [G]``
    int32 -> ``[M, N]``."""
    return _ragged_dot(lhs, rhs, group_sizes, config.transpose_rhs).astype(config.out_dtype)


def backward(lhs, rhs, group_sizes, dout, config: Config):
    """``(d_lhs [M, K], d_rhs)`` (``rhs``'s shape) in the primals' dtypes: ``dout`` times each row's
    ``rhs[g]ᵀ``, and per group ``lhs_gᵀ dout_g`` (the ragged-contracting product)."""
    _, vjp = jax.vjp(lambda a, b: _ragged_dot(a, b, group_sizes, config.transpose_rhs), lhs, rhs)
    d_lhs, d_rhs = vjp(dout.astype(acc_dtype(lhs, rhs)))
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


IMPLEMENTATION = Implementation("xla", always, forward, backward)
