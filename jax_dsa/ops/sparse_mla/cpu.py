"""The ``"cpu"`` implementation of ``sparse_mla``: C++ XLA FFI handlers on the host (``ffi/cpu``).

Shapes follow :func:`jax_dsa.sparse_mla` after it folds the batch dims into one:
``q [B, S_q, H, D_qk]``, ``kv [B, S_kv, D_qk]``, ``indices [B, S_q, K]`` int32,
``attn_sink [H]`` (float32; float64 for float64 q), ``topk_length [B, S_q]`` int32.
The handlers are registered by :mod:`jax_dsa._native`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsa import _native
from jax_dsa.ops.registry import Implementation, native_unavailable
from jax_dsa.ops.sparse_mla.config import Call, Config

CPU_FWD_TARGET = "jax_dsa_sparse_mla_fwd_cpu"
CPU_BWD_TARGET = "jax_dsa_sparse_mla_bwd_cpu"


def sink_dtype(dtype) -> jnp.dtype:
    """The handlers take attn_sink in the accumulation type: float64 for float64 q, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def cpu_forward(q, kv, indices, attn_sink, topk_length, *, sm_scale, d_v):
    """Host forward: ``out [B, S_q, H, d_v]`` (q's dtype), ``lse [B, S_q, H]`` float32
    (+inf for rows without a valid slot) and ``max_logits [B, S_q, H]`` float32 (-inf for them)."""
    _native.require("_cpu")
    lead = q.shape[:-1]
    call = jax.ffi.ffi_call(
        CPU_FWD_TARGET,
        (jax.ShapeDtypeStruct(lead + (d_v,), q.dtype), jax.ShapeDtypeStruct(lead, jnp.float32),
         jax.ShapeDtypeStruct(lead, jnp.float32)),
        # Unbatched operands get a size-1 leading dim; the handler broadcasts over it.
        vmap_method="expand_dims",
    )
    return call(q, kv, indices, attn_sink.astype(sink_dtype(q.dtype)), topk_length,
                sm_scale=np.float64(sm_scale), d_v=np.int64(d_v))


def cpu_backward(q, kv, indices, attn_sink, topk_length, out, lse, dout, *, sm_scale, d_v):
    """Host backward: ``dq`` (q's shape), ``dkv`` (kv's shape) and ``d_attn_sink [H]``.

    ``d_attn_sink`` is summed over the batch and has the accumulation dtype of :func:`sink_dtype`.
    """
    _native.require("_cpu")
    sdt = sink_dtype(q.dtype)
    call = jax.ffi.ffi_call(
        CPU_BWD_TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(kv.shape, kv.dtype),
            jax.ShapeDtypeStruct(attn_sink.shape, sdt),
        ),
        vmap_method="expand_dims",
    )
    return call(q, kv, indices, attn_sink.astype(sdt), topk_length, out, lse,
                dout.astype(q.dtype), sm_scale=np.float64(sm_scale), d_v=np.int64(d_v))


def supported(call: Call) -> str | None:
    """The host handlers take every call (any float dtype, heads, widths and slot counts)."""
    del call
    return native_unavailable("cpu", "_cpu")


def _forward(q, kv, indices, sink, lengths, config: Config):
    return cpu_forward(q, kv, indices, sink, lengths, sm_scale=config.sm_scale, d_v=config.d_v)


def _backward(q, kv, indices, sink, lengths, out, lse, dout, config: Config):
    dq, dkv, dsink = cpu_backward(q, kv, indices, sink, lengths, out, lse, dout,
                                  sm_scale=config.sm_scale, d_v=config.d_v)
    return dq, dkv, dsink.astype(sink.dtype)


IMPLEMENTATION = Implementation("cpu", supported, _forward, _backward, platforms=("cpu",))
