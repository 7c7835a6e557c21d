"""The ``"cuda"`` implementation of ``grouped_matmul``: jax_dsa's SM90 grouped-GEMM kernels
(``ffi/cuda/grouped_matmul``: persistent, TMA loads, warp-specialised wgmma, compiled ahead of
time into the ``_cuda`` FFI module).

Three kernels serve both weight layouts by role: ``fwd`` (``lhs · rhs[g]``), ``dgrad``
(``d_out · rhs[g]ᵀ``) and ``wgrad`` (per group ``lhs_gᵀ · d_out_g``, a ragged contraction).
With ``transpose_rhs`` (``rhs [G, N, K]``) the forward is the ``dgrad`` kernel, the input
gradient the ``fwd`` one and the weight gradient ``wgrad`` with its operands swapped: no
transposed copy of the experts is made. bfloat16 in and out, float32 accumulation; ``K`` and
``N`` multiples of 64; at most 1024 groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa import _native
from jax_dsa.ops.grouped_matmul.config import Call, Config
from jax_dsa.ops.registry import Implementation, native_unavailable, sm90_device_error

FWD_TARGET = "jax_dsa_grouped_matmul_fwd_cuda"
DGRAD_TARGET = "jax_dsa_grouped_matmul_dgrad_cuda"
WGRAD_TARGET = "jax_dsa_grouped_matmul_wgrad_cuda"
MAX_GROUPS = 1024
WIDTH_MULTIPLE = 64


def supported(call: Call) -> str | None:
    """Why the kernels cannot take ``call``, or None."""
    why = native_unavailable("cuda", "_cuda") or sm90_device_error()
    if why:
        return why
    if jnp.dtype(call.dtype) != jnp.bfloat16 or jnp.dtype(call.out_dtype) != jnp.bfloat16:
        return (f"implementation='cuda' needs bfloat16 operands and result, got {call.dtype} -> "
                f"{call.out_dtype}")
    if call.k % WIDTH_MULTIPLE or call.n % WIDTH_MULTIPLE or min(call.k, call.n) < 1:
        return (f"implementation='cuda' needs K and N multiples of {WIDTH_MULTIPLE}, got "
                f"K={call.k}, N={call.n}")
    if not 1 <= call.groups <= MAX_GROUPS:
        return f"implementation='cuda' takes 1 to {MAX_GROUPS} groups, got G={call.groups}"
    if max(call.m, call.k, call.n) >= 2**31 or call.groups * call.k >= 2**31:
        return "implementation='cuda' needs M, K, N and G*K below 2**31"
    return None


def _call(target, a, b, sizes, shape):
    g = sizes.shape[0]
    workspace = _native.require("_cuda").grouped_matmul_workspace_bytes(g)
    out, _ = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
    )(a, b, sizes)
    return out


def _fwd(lhs, rhs, sizes):  # lhs [M, K] . rhs[g] [K, N]
    return _call(FWD_TARGET, lhs, rhs, sizes, (lhs.shape[0], rhs.shape[2]))


def _dgrad(d_out, rhs, sizes):  # d_out [M, N] . rhs[g]ᵀ, rhs [G, K, N] -> [M, K]
    return _call(DGRAD_TARGET, d_out, rhs, sizes, (d_out.shape[0], rhs.shape[1]))


def _wgrad(lhs, d_out, sizes):  # per group lhs_gᵀ . d_out_g -> [G, K, N]
    return _call(WGRAD_TARGET, lhs, d_out, sizes, (sizes.shape[0], lhs.shape[1], d_out.shape[1]))


def forward(lhs, rhs, group_sizes, config: Config):
    if config.transpose_rhs:  # rhs [G, N, K]: lhs . rhs[g]ᵀ
        return _dgrad(lhs, rhs, group_sizes)
    return _fwd(lhs, rhs, group_sizes)


def backward(lhs, rhs, group_sizes, dout, config: Config):
    dout = dout.astype(jnp.bfloat16)
    if config.transpose_rhs:
        return _fwd(dout, rhs, group_sizes), _wgrad(dout, lhs, group_sizes)
    return _dgrad(dout, rhs, group_sizes), _wgrad(lhs, dout, group_sizes)


IMPLEMENTATION = Implementation("cuda", supported, forward, backward, platforms=("gpu",))
