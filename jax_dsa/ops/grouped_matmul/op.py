"""``grouped_matmul``: rows of ``lhs`` grouped by ``group_sizes``, each group times its own
matrix (the routed experts of a mixture-of-experts layer).

The contract is ``jax.lax.ragged_dot``'s (mode 1, a ragged non-contracting dimension): rows
``[o_g, o_g + group_sizes[g])`` of ``lhs`` (``o_g`` the sizes' running sum) are multiplied by
``rhs[g]``; rows past the last group are zero. The VJP gives the input gradient (``dout`` times
each row's ``rhs[g]ᵀ``) and the weight gradient (per group, ``lhs_gᵀ dout_g``: a product whose
contracting dimension is ragged), as Megatron-LM's ``GroupedMLP`` and DeepSeek-V3's training
(arXiv:2412.19437) need them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops.checks import int32_slots
from jax_dsa.ops.grouped_matmul import cuda, xla
from jax_dsa.ops.grouped_matmul.config import Call, Config
from jax_dsa.ops.registry import Registry

REGISTRY = Registry(
    "grouped_matmul",
    (xla.IMPLEMENTATION, cuda.IMPLEMENTATION),
    preference={"gpu": ("cuda", "xla"), "default": ("xla",)},
)


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, implementation=None,
                   preferred_element_type=None):
    """``out[i] = lhs[i] @ rhs[g(i)]`` (``rhs[g(i)]ᵀ`` with ``transpose_rhs``), with ``g(i)`` the
    group that row ``i`` falls in.

    Args:
      lhs: ``[M, K]`` float (bfloat16 for the ``"cuda"`` kernels): rows sorted by group.
      rhs: ``[G, K, N]``, ``lhs``'s dtype: one matrix per group; ``[G, N, K]`` with
        ``transpose_rhs`` (PyTorch's ``[out, in]`` weight layout, as the checkpoints store the
        experts: no transposed copy is made).
      group_sizes: ``[G]`` integer rows per group, in order. Values only known at run time are
        clamped, never trusted: a negative size counts as 0, and rows past ``M`` are dropped
        (the running sum is clipped to ``[0, M]``), so no implementation reads or writes out of
        bounds. Rows past the sizes' sum give zeros.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (on a GPU ``("cuda", "xla")``, else ``"xla"``). ``"xla"``:
        ``jax.lax.ragged_dot``, any platform (XLA's GPU compiler expands it densely over the
        groups: work and memory grow with ``G * M``). ``"cuda"``: jax_dsa's SM90 grouped-GEMM
        kernels, compiled ahead of time; bfloat16, ``K`` and ``N`` multiples of 64, ``G <= 1024``.
      preferred_element_type: the result's dtype; default ``lhs``'s. Products accumulate in
        float32 (float64 for float64 inputs) whatever it is.

    Returns:
      ``[M, N]``.

    Gradients (``jax.custom_vjp``): ``lhs`` and ``rhs``; ``group_sizes`` takes none.

    Raises:
      TypeError: non-float or mismatched ``lhs``/``rhs``, non-integer ``group_sizes``, an
        argument that is no array, a ``preferred_element_type`` that is no float dtype.
      ValueError: wrong ranks or shapes (named by argument), an unknown implementation or one
        that does not support the call (its reason given).
      NotImplementedError: the requested implementations are not built in this install.
    """
    lhs, rhs = _array("lhs", lhs, jnp.asarray), _array("rhs", rhs, jnp.asarray)
    group_sizes = _array("group_sizes", group_sizes, int32_slots)
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    if not isinstance(transpose_rhs, bool):
        raise TypeError(f"grouped_matmul: transpose_rhs must be a Python bool, got {transpose_rhs!r}")
    _check(lhs, rhs, group_sizes, transpose_rhs)
    m, k = lhs.shape
    g, n = rhs.shape[0], rhs.shape[1 if transpose_rhs else 2]
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    impl = REGISTRY.choose(implementation, Call(jnp.dtype(lhs.dtype), m, k, n, g, out_dtype))
    config = Config(impl, out_dtype, transpose_rhs)
    return _grouped_matmul(lhs, rhs, clamp_group_sizes(group_sizes, m), config)


def _array(name, x, convert):
    """``convert(x)``, or a TypeError naming the argument where ``x`` is no numeric array."""
    try:
        a = convert(x)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(f"grouped_matmul: {name} must be a numeric array, got "
                        f"{type(x).__name__}") from None
    if not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == jnp.bool_):
        raise TypeError(f"grouped_matmul: {name} must be a numeric array, got dtype {a.dtype}")
    return a


def _out_dtype(lhs_dtype, preferred_element_type):
    """The result dtype: ``lhs``'s, or ``preferred_element_type`` (a float dtype)."""
    if preferred_element_type is None:
        return jnp.dtype(lhs_dtype)
    try:
        dtype = jnp.dtype(preferred_element_type)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"grouped_matmul: preferred_element_type must be a float dtype or None, "
                        f"got {preferred_element_type!r}")
    return dtype


def clamp_group_sizes(group_sizes, m):
    """``group_sizes`` as int32 with negative sizes 0 and the running sum clipped to ``[0, m]``
    (each size is first clipped to ``m``, so the sum cannot overflow for ``G * M < 2**31``)."""
    ends = jnp.minimum(jnp.cumsum(jnp.clip(group_sizes.astype(jnp.int32), 0, m)), m)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def _check(lhs, rhs, group_sizes, transpose_rhs):
    name = "grouped_matmul"
    layout = "[G, N, K] (transpose_rhs)" if transpose_rhs else "[G, K, N]"
    if lhs.ndim != 2:
        raise ValueError(f"{name}: lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"{name}: rhs must be {layout}, got shape {rhs.shape}")
    rhs_k = rhs.shape[2 if transpose_rhs else 1]
    if rhs_k != lhs.shape[1]:
        raise ValueError(
            f"{name}: rhs's K {rhs_k} must equal lhs's K {lhs.shape[1]} (lhs {lhs.shape}, rhs "
            f"{rhs.shape} as {layout})")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"{name}: group_sizes must be [G] = ({rhs.shape[0]},) like rhs's group dim, got "
            f"shape {group_sizes.shape}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating) or lhs.dtype != rhs.dtype:
        raise TypeError(
            f"{name}: lhs and rhs must share one float dtype, got {lhs.dtype} and {rhs.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{name}: group_sizes must be an integer array, got {group_sizes.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs, rhs, group_sizes, config: Config):
    return config.implementation.forward(lhs, rhs, group_sizes, config)


def _fwd_rule(lhs, rhs, group_sizes, config):
    out = config.implementation.forward(lhs, rhs, group_sizes, config)
    return out, (lhs, rhs, group_sizes)


def _bwd_rule(config, residuals, dout):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = config.implementation.backward(lhs, rhs, group_sizes, dout, config)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_fwd_rule, _bwd_rule)
